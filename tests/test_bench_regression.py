"""bench/regression.py's arithmetic: medians over rounds, head / base, and the 5% goal on CPU figures."""

from __future__ import annotations

from bench.regression import CPU_BOUND, figure, figures


def test_a_figure_is_the_ratio_of_the_medians_and_meets_its_bound_at_most() -> None:
    """The ratio is head's median over base's; a ratio of exactly the bound meets it, one just above does not."""
    at_bound = figure([100.0, 300.0, 200.0], [210.0, 190.0, 500.0], CPU_BOUND)
    assert (at_bound["base"], at_bound["head"], at_bound["ratio"]) == (200.0, 210.0, 1.05)
    assert at_bound["met"] is True
    assert at_bound["goal"] == "ratio <= 1.05"
    above = figure([200.0], [211.0], CPU_BOUND)
    assert above["ratio"] == 1.055
    assert above["met"] is False
    assert figure([200.0], [150.0], CPU_BOUND)["met"] is True


def test_a_figure_without_a_bound_has_no_goal_and_a_zero_base_has_no_ratio() -> None:
    """Latency and memory are reported without a goal; a base of zero gives no ratio and so misses its goal."""
    plain = figure([1.0, 3.0], [2.0, 2.0], None)
    assert plain["ratio"] == 1.0
    assert "goal" not in plain
    assert "met" not in plain
    zero = figure([0.0], [5.0], CPU_BOUND)
    assert zero["ratio"] is None
    assert zero["met"] is False


def test_only_cpu_figures_carry_the_goal_and_every_round_is_kept() -> None:
    """figures() gives each key both sides measured; those about CPU get the 5% goal, the others none."""
    rounds = {
        "base": [{"gateway_cpu_us_per_snapshot": 100.0, "gateway_rss_mib": 90.0}],
        "head": [{"gateway_cpu_us_per_snapshot": 104.0, "gateway_rss_mib": 99.0}],
    }
    result = figures(rounds)
    assert result["gateway_cpu_us_per_snapshot"]["met"] is True
    assert result["gateway_cpu_us_per_snapshot"]["head_rounds"] == [104.0]
    assert "met" not in result["gateway_rss_mib"]
    assert result["gateway_rss_mib"]["ratio"] == 1.1
