"""The agent's ring buffer reduces each GPU's windows and says how much of each its readings cover."""

from __future__ import annotations

from gpuscaler.model.aggregation import WindowFunction
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.pods import uid_key
from gpuscaler.model.samples import PodRef, ProcessUsage
from gpuscaler.model.windows import Windowed, WindowKey
from gpuscaler.signals.evaluator import Evaluator
from tests.builders import gpu_sample, history_of, series, snapshot

AVG_2M = WindowKey(Metric.GPU_UTILIZATION, 120.0, WindowFunction.AVG)


def test_a_window_that_began_with_the_agent_answers_from_its_readings_and_says_how_much_it_covers() -> None:
    """Seven ticks a second apart into a 2-minute window: their average, covering 7 s of the 120."""
    history = series([[50.0], [50.0], [50.0], [50.0], [50.0], [50.0], [64.0]])
    latest = history.latest
    assert latest is not None
    assert history.windowed(latest.samples[0], AVG_2M) == Windowed(52.0, 7, covered_seconds=7.0)


def test_a_window_the_history_reaches_across_is_whole() -> None:
    """Once the buffer holds a window's length, its windows are whole (None) and longer ones still short."""
    history = series([[10.0]] * 31)  # ticks at 0 ... 30 s
    latest = history.latest
    assert latest is not None
    sample = latest.samples[0]
    for seconds in (10.0, 30.0, 30.5):
        whole = history.windowed(sample, AVG_2M._replace(seconds=seconds))
        assert whole.covered_seconds is None, seconds
    assert history.windowed(sample, AVG_2M).covered_seconds == 31.0


def test_a_gpu_read_only_lately_covers_from_its_first_readable_sample() -> None:
    """A GPU unreadable for the first five ticks covers the window from its first reading, the other GPU all."""
    history = series([[None, 20.0]] * 5 + [[30.0, 20.0]] * 36)  # ticks at 0 ... 40 s
    latest = history.latest
    assert latest is not None
    late, steady = (history.windowed(sample, AVG_2M._replace(seconds=40.0)) for sample in latest.samples)
    assert late == Windowed(30.0, 36, covered_seconds=36.0)
    assert steady == Windowed(20.0, 41)


def test_a_rate_covers_the_span_between_its_first_and_last_reading() -> None:
    """power_average over 60 s from five readings a second apart: 100 W, over the 4 s between them."""
    ticks = [snapshot(i + 1, float(i), (gpu_sample(0, energy=1000.0 + 100.0 * i),)) for i in range(5)]
    history = history_of(*ticks)
    window = WindowKey(Metric.POWER_AVERAGE, 60.0, WindowFunction.AVG)
    assert history.windowed(ticks[-1].samples[0], window) == Windowed(100.0, 5, covered_seconds=4.0)


def test_a_pods_own_share_covers_the_ticks_that_had_its_processes() -> None:
    """On a GPU two pods hold, read for 5 s and its processes only for the last two ticks: each pod's own share
    covers 2 s of the window (ticks without the figures are left out), the whole GPU all of it."""
    uid_a, uid_b = "1b4e2a3c-1111-2222-3333-444455556666", "9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
    pods = (PodRef("ml", "a", "c"), PodRef("ml", "b", "c"))
    processes = (ProcessUsage(1, uid_a, None, 40.0, None, None), ProcessUsage(2, uid_b, None, 20.0, None, None))
    ticks = [
        snapshot(i + 1, float(i), (gpu_sample(0, util=60.0, pods=pods, processes=processes if i >= 3 else None),))
        for i in range(5)
    ]
    windowed = history_of(*ticks).windowed(ticks[-1].samples[0], AVG_2M._replace(seconds=4.0))
    assert (windowed.value, windowed.covered_seconds) == (60.0, None)
    assert windowed.shares == {
        uid_key(uid_a): Windowed(40.0, 2, covered_seconds=2.0),
        uid_key(uid_b): Windowed(20.0, 2, covered_seconds=2.0),
    }


async def test_a_read_of_a_new_window_length_leaves_the_kept_series_as_found() -> None:
    """KEDA's evaluation of a 2-minute window keeps its series for the newest snapshot; a read (Explain) of a 45 s
    window answers from the same readings and keeps no series of its own: the history keeps what it kept before."""
    history = series([[50.0]] * 7 + [[64.0]])
    evaluator = Evaluator(history, clock=lambda: 7.0)
    metadata = {"windowFunction": "avg"}
    assert evaluator.evaluate(evaluator.parse(metadata | {"window": "2m"}, "ml", "so").value).value == 51.75
    kept = dict(history._series.current)
    assert list(kept) == [120.0]
    assert (await evaluator.read(evaluator.parse(metadata | {"window": "45s"}, "ml", "so"))).value == 51.75
    assert history._series.current == kept
