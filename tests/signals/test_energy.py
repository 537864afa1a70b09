"""Energy while idle: the interval definition, figures over a window, and the counters /metrics exports."""

from __future__ import annotations

import random
from dataclasses import astuple

import pytest

from gpuscaler.model.samples import PodRef, Snapshot, gpu_keys
from gpuscaler.signals.energy import IdleEnergyCounter, idle_energy, interval, pods_of
from tests.builders import gpu_sample, history_of, snapshot

A = PodRef("ml", "vllm-a", "server")
B = PodRef("ml", "vllm-b", "server")


@pytest.mark.parametrize(
    ("before", "after", "joules", "idle"),
    [
        pytest.param((100.0, 0.0), (160.0, 0.0), 60.0, True, id="idle"),
        pytest.param((100.0, 0.0), (400.0, 1.0), 300.0, False, id="one-percent-is-busy"),
        pytest.param((100.0, 50.0), (160.0, 0.0), 60.0, True, id="closing-sample-decides"),
        pytest.param((None, 0.0), (160.0, 0.0), None, None, id="energy-unread"),
        pytest.param((100.0, 0.0), (160.0, None), 60.0, None, id="utilisation-unread"),
        pytest.param((9000.0, 0.0), (10.0, 0.0), None, None, id="counter-restarted"),
    ],
)
def test_an_interval_is_idle_when_its_closing_sample_saw_no_kernel(
    before: tuple[float | None, float | None],
    after: tuple[float | None, float | None],
    joules: float | None,
    idle: bool | None,
) -> None:
    """An interval's energy is the counter's increase; idle when the closing gpu_utilization is 0; else unknown."""
    part = interval(
        gpu_sample(0, energy=before[0], util=before[1]), 10.0, gpu_sample(0, energy=after[0], util=after[1]), 11.0
    )
    assert (part.seconds, part.joules, part.idle) == (1.0, joules, idle)


def tick(sequence: int, *gpus: tuple[float | None, float | None], pods: tuple[PodRef, ...] = ()) -> Snapshot:
    """Tick ``sequence`` one second after the previous, each GPU as (energy J, gpu_utilization %)."""
    samples = tuple(gpu_sample(i, energy=e, util=u, pods=pods) for i, (e, u) in enumerate(gpus))
    return snapshot(sequence, float(sequence), samples)


def test_idle_energy_over_a_window_sums_idle_and_busy_and_says_what_is_unknown() -> None:
    """Idle and busy joules over the window, each GPU once; intervals without readings are unknown seconds."""
    history = history_of(
        tick(1, (0.0, 0.0), (0.0, 0.0)),
        tick(2, (80.0, 0.0), (500.0, 90.0)),  # GPU 0 idle 80 J, GPU 1 busy 500 J
        tick(3, (160.0, 0.0), (None, 90.0)),  # GPU 0 idle 80 J, GPU 1 unknown
        tick(4, (560.0, 20.0), (900.0, 0.0)),  # GPU 0 busy 400 J, GPU 1 still unknown (no previous reading)
    )
    latest = history.latest
    assert latest is not None
    figure = idle_energy(history, gpu_keys([*latest.samples, *latest.samples]), window_seconds=10.0)
    assert (figure.idle_joules, figure.busy_joules, figure.unknown_seconds, figure.gpus) == (160.0, 900.0, 2.0, 2)
    assert figure.seconds == 3.0
    assert figure.idle_share == pytest.approx(160.0 / 1060.0)
    shorter = idle_energy(history, gpu_keys(latest.samples[:1]), window_seconds=1.0)
    assert (shorter.idle_joules, shorter.busy_joules) == (0.0, 400.0)


def test_the_counter_counts_each_idle_interval_once_per_gpu_and_per_owner() -> None:
    """Per GPU and per pod; a GPU two pods share counts in full for each pod, but once per owner."""
    counter = IdleEnergyCounter(pods_of)
    for snapshot_ in (
        tick(1, (0.0, 0.0), pods=(A, B, A)),
        tick(2, (70.0, 0.0), pods=(A, B, A)),
        tick(3, (400.0, 80.0), pods=(A, B, A)),
        tick(4, (470.0, 0.0), pods=(A, B, A)),
    ):
        counter.observe(snapshot_)
    [(sample, joules)] = counter.gpu_totals()
    assert (sample.gpu.index, joules) == (0, 140.0)
    assert {owner: total.idle_joules for owner, total in counter.by_owner.items()} == {
        ("ml", "vllm-a"): 140.0,
        ("ml", "vllm-b"): 140.0,
    }


def test_a_gpu_that_leaves_its_node_takes_its_counter_with_it() -> None:
    """When a node's snapshot no longer has a GPU, its series ends; the other GPUs keep counting."""
    counter = IdleEnergyCounter(pods_of)
    counter.observe(tick(1, (0.0, 0.0), (0.0, 0.0)))
    counter.observe(tick(2, (10.0, 0.0), (20.0, 0.0)))
    counter.observe(tick(3, (30.0, 0.0)))
    assert [(s.gpu.index, j) for s, j in counter.gpu_totals()] == [(0, 30.0)]
    counter.forget_node("node-a")
    assert counter.gpu_totals() == []


def test_the_counter_agrees_with_the_history_whether_a_tick_is_counted_by_column_or_by_gpu() -> None:
    """Over 80 ticks of four GPUs, mostly busy with rising counters (counted column by column) and now and then
    idle, unread or restarted (counted GPU by GPU), the counter's figures equal ``idle_energy`` over the same
    history, and per-owner joules equal the idle joules of the pod's one GPU."""
    rng = random.Random(3)
    counter = IdleEnergyCounter(pods_of)
    energies = [1000.0 * gpu for gpu in range(4)]
    ticks = []
    for sequence in range(1, 81):
        gpus = []
        for gpu in range(4):
            energies[gpu] += rng.uniform(50.0, 300.0)
            roll = rng.random()
            energy: float | None = energies[gpu]
            util: float | None = rng.choice([30.0, 75.0, 100.0])
            if roll < 0.05:
                util = 0.0
            elif roll < 0.07:
                energy = None
            elif roll < 0.09:
                util = None
            elif roll < 0.1:
                energies[gpu] = energy = rng.uniform(0.0, 10.0)  # the driver reloaded: the counter restarts
            gpus.append((energy, util))
        ticks.append(tick(sequence, *gpus, pods=(A,)))
        counter.observe(ticks[-1])
    latest = ticks[-1].samples
    expected = idle_energy(history_of(*ticks), gpu_keys(latest), window_seconds=None)
    assert astuple(counter.summary(gpu_keys(latest))) == pytest.approx(astuple(expected))
    assert expected.idle_joules > 0  # both paths were taken
    assert expected.unknown_seconds > 0
    for index in range(4):
        alone = idle_energy(history_of(*ticks), gpu_keys(latest[index : index + 1]), window_seconds=None)
        assert dict(counter.gpu_totals())[latest[index]] == pytest.approx(alone.idle_joules)
    assert counter.by_owner[("ml", "vllm-a")].idle_joules == pytest.approx(expected.idle_joules)
