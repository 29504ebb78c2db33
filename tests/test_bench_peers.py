"""bench/peers' statistics: the paired ratio's interval (what a run of rounds can and
cannot decide) and the micro-batches of llama-server's busy slots."""

from __future__ import annotations

import statistics

from bench.peers import interval, micro_batches


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


def test_slots_in_one_run_of_ids_are_one_micro_batch() -> None:
    assert micro_batches([4, 5, 6, 7]) == 1
    assert micro_batches([0, 1, 2, 3, 4, 5, 6, 7]) == 1


def test_a_gap_in_the_ids_costs_a_micro_batch() -> None:
    assert micro_batches([2, 5, 6, 7]) == 2
    assert micro_batches([0, 2, 4, 6]) == 4
    assert micro_batches([]) == 0
