"""bench/peers' paired-ratio interval: what a run of rounds can and cannot decide."""

from __future__ import annotations

import statistics

from bench.peers import interval


def test_rounds_that_agree_give_a_point() -> None:
    assert interval([1.04] * 5) == (1.04, 1.04)


def test_the_interval_holds_the_median_within_the_rounds() -> None:
    ratios = [0.93, 1.02, 0.99, 1.05, 0.97, 1.01, 0.96]
    low, high = interval(ratios)
    assert min(ratios) <= low <= statistics.median(ratios) <= high <= max(ratios)
    assert low < high


def test_more_rounds_of_the_same_spread_narrow_it() -> None:
    spread = [0.92, 0.96, 1.0, 1.04, 1.08]
    few_low, few_high = interval(spread)
    many_low, many_high = interval(spread * 9)
    assert many_high - many_low < few_high - few_low
    assert many_low <= 1.0 <= many_high


def test_one_run_prints_one_interval() -> None:
    ratios = [0.9, 1.1, 1.0, 0.95]
    assert interval(ratios) == interval(list(ratios))
