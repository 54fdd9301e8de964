"""The vLLM benchmark's ratios are paired within repeats: a host whose speed drifts between
repeats slows both sides of a ratio alike, so the median of per-repeat ratios, not the ratio
of medians, is what a method buys."""

import pytest

from pipeline.bench.vllm_tables import format_tables, held_out_ks, summarize


def _run(method: str, repeat: int, tok_s: float) -> dict:
    cell = {"domain": "code", "temperature": 0.0, "concurrency": 1, "tok_s": tok_s}
    return {
        "method": method,
        "repeat": repeat,
        "cells": [cell | {"tokens": tok_s, "wall_s": 1.0, "outputs": [[1]]}],
    }


def test_ratios_to_none_and_floor_are_paired_within_repeats():
    # repeat 1 ran on a host twice as fast: every method doubled
    rates = {
        "none": [100, 200, 100],
        "draft_model:k=2": [90, 240, 120],
        "ours:k=2": [110, 210, 90],
    }
    runs = [_run(m, r, v) for m, vs in rates.items() for r, v in enumerate(vs)]
    summary = summarize(runs)
    rows = summary["cells"][0]["methods"]
    ours = rows["ours:k=2"]
    assert ours["tok_s"] == 110  # the median rate, unpaired
    assert ours["vs_none"] == pytest.approx(1.05)  # median of 1.1, 1.05, 0.9 (not 110/100)
    # floor: max(none, the best fixed K by median = draft_model:k=2) within each repeat:
    # 110/100, 210/240, 90/120: median 0.875 (the ratio of medians would say 110/120)
    assert ours["vs_floor"] == pytest.approx(0.875)
    assert (ours["vs_floor_min"], ours["vs_floor_max"]) == pytest.approx((0.75, 1.1))
    assert rows["draft_model:k=2"]["vs_floor"] is None  # only ours has a floor
    assert summary["pooled"]["ours:k=2"]["vs_none"] == pytest.approx(1.05)
    # each repeat's too, in repeat order, and printed: any two methods pair repeat by repeat
    each = summary["pooled"]["ours:k=2"]["vs_none_per_repeat"]
    assert list(each) == [0, 1, 2] and list(each.values()) == pytest.approx([1.1, 1.05, 0.9])
    assert "1.100 1.050 0.900" in format_tables(summary, "h")


def test_a_floor_can_take_the_k_another_run_chose():
    """--floor-from: ours' floor is the one arm another run found best, not the better of
    none and this run's best K (chosen on this run's own noise)."""
    rates = {
        "none": [100, 100, 100],
        "draft_model:k=2": [120, 110, 130],
        "draft_model:k=3": [125, 100, 125],  # this run's best by median (125 > 120)
        "ours:k=4": [120, 120, 120],
    }
    runs = [_run(m, r, v) for m, vs in rates.items() for r, v in enumerate(vs)]
    assert summarize(runs)["cells"][0]["methods"]["ours:k=4"]["vs_floor"] == pytest.approx(0.96)
    earlier = summarize(
        [
            _run(m, r, v)
            for m, v in (("draft_model:k=2", 130), ("draft_model:k=3", 90))
            for r in (0,)
        ]
    )
    chosen = held_out_ks(earlier)
    assert list(chosen.values()) == [{"draft_model:": "draft_model:k=2"}]
    summary = summarize(runs, chosen)
    # 120/120, 120/110, 120/130: median 1.0
    assert summary["cells"][0]["methods"]["ours:k=4"]["vs_floor"] == pytest.approx(1.0)
    assert summary["cells"][0]["floor_ks"] == {"draft_model:": "draft_model:k=2"}
    assert "floor from another run: draft_model:k=2" in format_tables(summary, "h")
    # a K this run lacks: its own best, as without
    other = summarize(runs, {k: {"draft_model:": "draft_model:k=9"} for k in chosen})
    assert other["cells"][0]["methods"]["ours:k=4"]["vs_floor"] == pytest.approx(0.96)
    # where the other run found none faster than every K, the floor is none alone
    slower = summarize([_run(m, 0, v) for m, v in (("none", 150), ("draft_model:k=2", 130))])
    assert list(held_out_ks(slower).values()) == [{"draft_model:": "none"}]
    alone = summarize(runs, held_out_ks(slower))
    assert alone["cells"][0]["methods"]["ours:k=4"]["vs_floor"] == pytest.approx(1.2)


def test_a_repeat_where_a_peer_failed_is_left_out_not_misaligned():
    rates = {"none": [100, 200, 100], "ours:k=2": [110, 210, 90]}
    runs = [_run(m, r, v) for m, vs in rates.items() for r, v in enumerate(vs)]
    runs = [r for r in runs if (r["method"], r["repeat"]) != ("none", 1)]  # failed there
    ours = summarize(runs)["cells"][0]["methods"]["ours:k=2"]
    assert ours["vs_none"] == pytest.approx(1.0)  # median of 1.1 and 0.9: repeats 0 and 2
