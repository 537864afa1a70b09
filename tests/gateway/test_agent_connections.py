"""The gateway's connections to its agents: h2's, less the repr of every frame taken in."""

from __future__ import annotations

import hyperframe.frame
import pytest

from tests.fakes.fake_kubelet import FakeKubelet, short_socket_path
from tests.gateway.conftest import StartGateway, StartNode
from tests.waiting import until


async def test_frames_from_an_agent_build_no_repr(
    start_node: StartNode, start_gateway: StartGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Snapshots streamed from an agent reach the gateway without any frame's repr made (h2 makes one per frame)."""
    reprs = 0
    original = hyperframe.frame.Frame.__repr__

    def counted(frame: hyperframe.frame.Frame) -> str:
        nonlocal reprs
        reprs += 1
        return original(frame)

    monkeypatch.setattr(hyperframe.frame.Frame, "__repr__", counted)
    # A kubelet never started: the agent's own grpclib client to it takes in no frames, so every frame counted
    # here is one of the two ends of the gateway's stream (the agent's server end skips the repr too).
    node = await start_node("node-0", kubelet=FakeKubelet(short_socket_path()))
    gateway = await start_gateway(node)
    await until(lambda: sum(subscriber.received for subscriber, _ in gateway.subscribers.values()) >= 5)
    assert reprs == 0
