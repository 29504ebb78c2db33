"""bench/peers' statistics: the paired ratio's interval (what a run of rounds can and
cannot decide) and the micro-batches of llama-server's busy slots."""

from __future__ import annotations

import statistics

from bench.peers import (
    TOKENS_A_LINE,
    arrival_plan,
    document,
    interval,
    micro_batches,
    percentile,
)


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


def test_an_arrival_plan_is_the_same_schedule_for_every_server_of_a_round() -> None:
    plan = arrival_plan(0.25, 16, 3)
    assert plan == arrival_plan(0.25, 16, 3)
    assert plan != arrival_plan(0.25, 16, 4)
    assert plan[0][0] == 0.0
    assert [at for at, _ in plan] == sorted(at for at, _ in plan)
    assert all(300 <= size <= 2600 for _, size in plan)
    faster = arrival_plan(1.0, 400, 3)
    assert 300 < faster[-1][0] < 500  # about one a second


def test_percentiles_of_a_few_values_are_values_seen() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert percentile([5.0], 0.99) == 5.0


def test_documents_are_new_text_of_about_the_size_asked() -> None:
    assert document(2048, 1) == document(2048, 1)
    assert document(2048, 1) != document(2048, 2)
    lines = document(2048, 1).count("\n") + 1
    assert abs(lines * TOKENS_A_LINE - 2048) < TOKENS_A_LINE
