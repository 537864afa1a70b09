"""The `gpuscaler` command against an in-process agent: query as KEDA would, and drive fake GPUs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from gpuscaler import __version__
from gpuscaler.agent.process import Agent
from gpuscaler.cli import main
from tests.conftest import StartAgent
from tests.server.test_external_scaler import next_tick


async def run_cli(*argv: str) -> int:
    """Runs `gpuscaler ARGV...` in a thread (it runs its own event loop) and returns its exit code."""
    return await asyncio.to_thread(main, list(argv), {})


async def test_query_json_shows_what_keda_gets(agent: Agent, capsys: pytest.CaptureFixture[str]) -> None:
    """`query --output json` has the four RPC answers, the per-GPU explanation and both HPA results."""
    code = await run_cli("fake", "set", "--address", f"127.0.0.1:{agent.port}", "--gpu", "all", "gpu_utilization=80")
    assert code == 0
    capsys.readouterr()
    await next_tick(agent)

    code = await run_cli(
        "query", "--address", f"127.0.0.1:{agent.port}", "--output", "json", "--replicas", "2", "targetValue=100"
    )
    report = json.loads(capsys.readouterr().out)

    assert code == 0
    assert report["get_metric_spec"]["fields"]["metricSpecs"][0]["metricName"] == "gpuscaler-gpu_utilization-sum"
    assert report["get_metrics"]["fields"]["metricValues"][0]["metricValueFloat"] == 320.0
    assert report["is_active"]["fields"]["result"] is True
    assert report["stream_is_active"]["fields"]["result"] is True
    assert [gpu["value"] for gpu in report["explanation"]["gpus"]] == [80.0] * 4
    assert report["replicas"] == {"AverageValue": 4, "Value": 7}


async def test_query_shows_errors_and_left_out_gpus(agent: Agent, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed GPU makes a small all-GPU query UNAVAILABLE (maxUnreadable), and within maxUnreadable appears as left
    out with its reason, in the table too; a query that names it shows KEDA's error."""
    address = f"127.0.0.1:{agent.port}"
    assert await run_cli("fake", "fail", "--address", address, "--gpu", "3", "--error", "lost") == 0
    await next_tick(agent)
    capsys.readouterr()

    assert await run_cli("query", "--address", address, "--output", "json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["get_metrics"]["code"] == "UNAVAILABLE"
    assert "1 of the 4 selected GPUs, and maxUnreadable 5% (the default)" in report["get_metrics"]["message"]
    gpus = report["explanation"]["gpus"]
    assert [gpu["included"] for gpu in gpus] == [True, True, True, False]
    assert "gpu_lost" in gpus[3]["reason"]

    assert await run_cli("query", "--address", address, "maxUnreadable=1") == 0
    table = capsys.readouterr().out
    assert "The value leaves out 1 of 4 GPU(s)" in table
    assert "GPU 3 (GPU-fake-test-node-3)" in table

    assert await run_cli("query", "--address", address, "--output", "json", "gpuIndex=3") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["get_metrics"]["code"] == "UNAVAILABLE"
    assert "GPU 3" in report["get_metrics"]["message"]
    assert report["replicas"] is None


async def test_query_table_names_each_rpc(agent: Agent, capsys: pytest.CaptureFixture[str]) -> None:
    """The table output names every RPC and the HPA line."""
    assert await run_cli("query", "--address", f"127.0.0.1:{agent.port}", "profile=batch") == 0
    out = capsys.readouterr().out
    for text in ("GetMetricSpec", "GetMetrics", "IsActive", "StreamIsActive", "HPA at 1 current replica"):
        assert text in out


async def test_fake_commands_refuse_bad_input(agent: Agent, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad fake values and GPUs fail with a message naming them, and change nothing."""
    address = f"127.0.0.1:{agent.port}"
    assert await run_cli("fake", "set", "--address", address, "--gpu", "9", "temperature=50") == 1
    assert "gpu 9 is out of range" in capsys.readouterr().err
    assert await run_cli("fake", "set", "--address", address, "--gpu", "0", "gpu_utilization=150") == 1
    assert "between 0 and 100" in capsys.readouterr().err
    assert await run_cli("fake", "set", "--address", address, "--gpu", "0", "speed=3") == 1
    assert "'speed' is not a metric" in capsys.readouterr().err


async def test_unreachable_server_is_one_line_that_says_what_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    """A client command against a closed port exits 1 in one line saying which address it could not reach and
    what should listen there: for `query` a gateway or an agent, for `fake` an agent with fake GPUs."""
    assert await run_cli("query", "--address", "127.0.0.1:9", "profile=batch") == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("gpuscaler query: cannot reach 127.0.0.1:9: connection refused; is a gateway")
    assert "or an agent (`gpuscaler serve`)" in line
    assert "127.0.0.1:6000, is make dev's gateway" in line
    assert await run_cli("fake", "heal", "--address", "127.0.0.1:9", "--gpu", "all") == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("gpuscaler fake heal: cannot reach 127.0.0.1:9: connection refused; is an agent with")
    assert "gateway" not in line


async def test_a_fake_change_answers_once_a_tick_has_read_it(start_agent: StartAgent) -> None:
    """`fake set` and `fake fail` return after a tick read the change, so a `query` right after sees it."""
    agent = await start_agent("--poll-interval", "1")
    address = f"127.0.0.1:{agent.port}"
    assert await run_cli("fake", "set", "--address", address, "--gpu", "all", "gpu_utilization=42") == 0
    latest = agent.evaluator.source.latest
    assert latest is not None
    assert [sample.gpu_utilization_percent for sample in latest.samples] == [42.0] * 4
    assert await run_cli("fake", "fail", "--address", address, "--gpu", "1", "--error", "lost") == 0
    latest = agent.evaluator.source.latest
    assert latest is not None
    assert latest.samples[1].errors


@pytest.mark.parametrize("output", ["table", "json"])
async def test_query_watch_into_a_pipe_writes_each_answer_and_ends_cleanly_on_sigterm(
    agent: Agent, output: str
) -> None:
    """`query --watch` into a pipe (a real process, no terminal) writes every answer as it comes, whole (tables
    under the time they were asked, or one JSON document a line), and SIGTERM ends it with 0 and nothing on
    stderr, its last answer written to the end."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuscaler", "query", "--address", f"127.0.0.1:{agent.port}", "--output", output,
        "--watch", "0.2", "profile=batch",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert process.stdout is not None
    read: list[bytes] = []
    try:
        async with asyncio.timeout(60):
            # Each line arrives as it is written: nothing waits in a buffer for the end.
            while sum(line.startswith((b"What KEDA gets", b'{"metadata"')) for line in read) < 2:
                read.append(await process.stdout.readline())
                assert read[-1], (await process.communicate())[1].decode()
        process.send_signal(signal.SIGTERM)
        rest, errors = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert (process.returncode, errors.decode()) == (0, "")
    lines = b"".join([*read, rest]).decode().splitlines()
    if output == "json":
        assert all(json.loads(line)["metadata"] == {"profile": "batch"} for line in lines)
    else:
        assert max(map(len, lines)) <= 80
        assert lines[-1].startswith("HPA at 1 current replica(s)"), lines[-1]


@pytest.mark.parametrize("argv", [["--version"], ["version"]])
def test_the_version_prints_with_the_flag_and_the_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuscaler --version` and `gpuscaler version` print the same line and exit 0."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's version action exits
        code = int(exit_.code or 0)
    assert code == 0
    assert capsys.readouterr().out == f"gpuscaler {__version__}\n"


@pytest.mark.parametrize(
    ("command", "said"),
    [(["query"], "the gateway's or an agent's HOST:PORT"), (["fake", "set"], "an agent's HOST:PORT, one started with")],
)
def test_address_help_names_what_each_command_talks_to(
    command: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`query --help` says its address is the gateway's (the dev stack's default) or an agent's; `fake` drives an
    agent's fake GPUs."""
    with pytest.raises(SystemExit):
        main([*command, "--help"], {})
    assert said in " ".join(capsys.readouterr().out.split())
