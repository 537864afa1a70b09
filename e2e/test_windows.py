"""Windows: one GPU's samples over ``window`` reduce with ``windowFunction`` before GPUs combine.

A single hot sample (one poll tick) must not activate an average over 10 s, and must activate a max.
"""

from __future__ import annotations

import asyncio

from e2e.support.clients import ScalerClient
from e2e.support.control import Control
from tests.builders import decoded

POLL_SECONDS = 0.2  # the ``agent`` fixture's interval
AVG = {"gpuIndex": "0", "window": "10s", "activationThreshold": "50"}
MAX = {**AVG, "windowFunction": "max"}


async def test_one_sample_spike_activates_max_not_avg(client: ScalerClient, control: Control) -> None:
    """A 100% spike for one tick activates a 10 s max window at once; a 10 s avg stays inactive, value diluted."""
    await asyncio.sleep(3.0)  # at least 15 idle samples in the window, so one spike is at most 1/15 of the avg
    average, highest = client.stream_is_active(AVG), client.stream_is_active(MAX)
    try:
        assert await average.next() is False
        assert await highest.next() is False

        spiked = await control.set_and_wait(0, {"gpu_utilization": 100})
        await control.set(0, {"gpu_utilization": 0})
        assert decoded(spiked).samples[0].gpu_utilization_percent == 100
        after = await control.next_tick()
        assert decoded(after).samples[0].gpu_utilization_percent == 0
        # Ticks that read 100: from `spiked` up to `after`, plus one that may have begun as the Set call returned.
        spikes = after.sequence - spiked.sequence + 1

        assert await highest.next(timeout=5) is True
        await average.no_message(1.0)
        assert await client.is_active(AVG) is False
        assert await client.is_active(MAX) is True
        diluted = await client.metric_value(AVG)
        assert 0 < diluted <= 100 * spikes / 15
        assert await client.metric_value(MAX) == 100
    finally:
        await average.close()
        await highest.close()


async def test_window_average_follows_a_value_that_holds(client: ScalerClient, control: Control) -> None:
    """A value held for most of a 2 s window does raise the windowed average above the threshold."""
    metadata = {"gpuIndex": "1", "window": "2s", "activationThreshold": "50"}
    stream = client.stream_is_active(metadata)
    try:
        assert await stream.next() is False
        await control.set(1, {"gpu_utilization": 90})
        assert await stream.next(timeout=5) is True
        assert await client.metric_value(metadata) > 50
    finally:
        await stream.close()
