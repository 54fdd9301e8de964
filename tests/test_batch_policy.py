"""The batch > 1 cost model (pipeline.cost.batch), the batch's plan of draft lengths
(pipeline.decode.batch_economy) against brute force, and the calibration job end to end."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from jobs import calibrate_batch
from pipeline.cost.batch import BatchCost
from pipeline.decode.batch_economy import BatchEconomy, expected, plan_lengths
from pipeline.decode.batching import BatchRecord

COST = BatchCost(
    b0=3.0,
    b_pos=0.09,
    b_union=0.35,
    b_ctx=0.0015,
    d0=1.2,
    d_tok=0.2,
    s0=1.0,
    s_row=0.4,
    experts=32,
    top_k=4,
    union_decay=0.95,
)


def _step_ms(cost: BatchCost, ks: list[int], contexts: list[int]) -> float:
    rounds = sum(cost.t_draft(sum(k >= j for k in ks)) for j in range(1, max(ks, default=0) + 1))
    attended = sum((1 + k) * c for k, c in zip(ks, contexts, strict=True))
    return cost.t_step_overhead(len(ks)) + cost.t_target(sum(ks) + len(ks), None, attended) + rounds


def _plan(economy: BatchEconomy, accepts, contexts, max_k) -> list[int]:
    """The lengths of one step, every generation already known (as from the step before)."""
    rows = list(enumerate(zip(accepts, contexts, strict=True)))
    for key, (a, c) in rows:
        economy.plan(key, a, max_k, c)
    economy.observe(BatchRecord("target", len(rows), len(rows), [4] * 4, 0, 0, 1.0))
    return [economy.plan(key, a, max_k, c) for key, (a, c) in rows]


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_within_a_percent_of_the_brute_force_optimum(seed):
    """Every k vector in [0, max_k]^B, priced exactly: the plan's ms per token is within 1%
    of the best (its rows' lengths are a linearised choice per round count)."""
    rng = random.Random(seed)
    rows, max_k = rng.choice([(2, 5), (3, 4), (4, 3)])
    accepts = [[rng.uniform(0.3, 0.98) for _ in range(max_k)] for _ in range(rows)]
    contexts = [rng.randint(50, 400) for _ in range(rows)]
    economy = BatchEconomy(COST)
    ks = _plan(economy, accepts, contexts, max_k)

    def rate(ks):
        tokens = sum(1 + expected(a, k) for a, k in zip(accepts, ks, strict=True))
        return _step_ms(COST, list(ks), contexts) / tokens

    best = min(rate(v) for v in itertools.product(range(max_k + 1), repeat=rows))
    assert economy.planned_rate == pytest.approx(rate(ks))
    assert rate(ks) <= best * 1.01, (ks, rate(ks), best)


@pytest.mark.parametrize("seed", range(4))
def test_each_generation_is_planned_within_its_own_max_k(seed):
    """Generations of one batch asking with different max_k (a batch mixing knobs), in either
    order: no generation drafts past its own max_k, a plan made when the smallest asked holds
    no other to that one, and the plan is within 1% of the best over each row's own range."""
    rng = random.Random(seed)
    caps = [1, 3, 5]
    accepts = [[rng.uniform(0.5, 0.98) for _ in range(6)] for _ in caps]  # longer than caps
    contexts = [rng.randint(50, 400) for _ in caps]
    cheap = BatchCost(**{**COST.to_json(), "d0": 0.05, "d_tok": 0.01})

    def rate(ks):
        tokens = sum(1 + expected(a, k) for a, k in zip(accepts, ks, strict=True))
        return _step_ms(cheap, list(ks), contexts) / tokens

    best = min(rate(v) for v in itertools.product(*(range(c + 1) for c in caps)))
    for order in ([0, 1, 2], [2, 1, 0]):
        economy = BatchEconomy(cheap)
        for key in order:
            economy.plan(key, accepts[key], caps[key], contexts[key])
        economy.observe(BatchRecord("target", 3, 3, [4] * 4, 0, 0, 1.0))
        ks = {key: economy.plan(key, accepts[key], caps[key], contexts[key]) for key in order}
        ks = [ks[key] for key in range(len(caps))]
        assert all(k <= c for k, c in zip(ks, caps, strict=True)), (order, ks)
        assert max(ks) > caps[0], (order, ks)  # cheap rounds: the longer caps are used
        assert economy.planned_rate == pytest.approx(rate(ks))
        assert rate(ks) <= best * 1.01, (order, ks, rate(ks), best)


def test_a_straggler_drafts_long_only_where_the_batch_gains():
    """Seven generations that rarely get a token accepted and one that is copying: with cheap
    rounds the copier drafts long; when a round costs what the others' waiting is worth, it
    drafts no further than the batch does."""
    low, high = [0.2] * 8, [0.97] * 8
    cheap = BatchCost(**{**COST.to_json(), "d0": 0.05, "d_tok": 0.01})
    dear = BatchCost(**{**COST.to_json(), "d0": 30.0})
    ks_cheap = _plan(BatchEconomy(cheap), [high] + [low] * 7, [100] * 8, 8)
    ks_dear = _plan(BatchEconomy(dear), [high] + [low] * 7, [100] * 8, 8)
    assert ks_cheap[0] >= 6 and max(ks_cheap[1:]) <= 1
    assert ks_dear[0] <= 1


def test_generations_that_leave_drop_out_of_the_plan():
    economy = BatchEconomy(COST)
    _plan(economy, [[0.9] * 4] * 3, [100] * 3, 4)
    for _ in range(3):  # three passes without generation 2
        economy.observe(BatchRecord("target", 2, 8, [8] * 4, 200, 0, 10.0))
        economy.plan(0, [0.9] * 4, 4, 100)
        economy.plan(1, [0.9] * 4, 4, 100)
    assert 2 not in economy._plan and set(economy._plan) == {0, 1}


def _records(cost: BatchCost, rng: random.Random) -> list[BatchRecord]:
    """Steps generated from ``cost`` exactly: chain rounds, then a verification pass."""
    out = []
    for _ in range(60):
        rows, k = rng.randint(1, 8), rng.randint(0, 5)
        ctx = rng.randint(100, 2000)
        positions = rows * (k + 1)
        u = cost.union(positions)
        step_gap = cost.t_step_overhead(rows)
        for j in range(k):
            t = cost.t_draft(rows)
            out.append(
                BatchRecord(
                    "draft",
                    rows,
                    rows,
                    [],
                    ctx,
                    0,
                    t / 2 if j == 0 else t / 2,
                    step_gap if j == 0 else t / 2,
                    rows if j == 0 else 0,
                )
            )
        target_gap = 0.0 if k else step_gap
        attended = positions * ctx // rows
        out.append(
            BatchRecord(
                "target",
                rows,
                positions,
                [round(u)] * 4,
                ctx,
                0,
                cost.t_target(positions, round(u), attended),
                target_gap,
                attended=attended,
            )
        )
    return out


def test_the_fit_recovers_the_coefficients_it_was_generated_from():
    truth = COST
    fit = BatchCost.fit(_records(truth, random.Random(0)), 32, 4)
    for name in ("b0", "b_pos", "b_union", "b_ctx", "d0", "d_tok", "s0", "s_row"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), abs=1e-6), name
    assert fit.union_decay == pytest.approx(truth.union_decay, abs=0.01)
    assert fit.r2_target > 0.999


def test_interrupted_passes_do_not_move_the_fit():
    """2% timing noise, and 5% of forwards 30 ms slower (a GC pause, another process): the
    robust fit prices passes and rounds within 1% of the truth (least squares would put the
    spikes' mean, about 1.5 ms, into every pass)."""
    rng = random.Random(0)
    records = []
    for r in (r for _ in range(3) for r in _records(COST, rng)):
        spike = 30.0 if rng.random() < 0.05 else 0.0
        records.append(dataclasses.replace(r, t_ms=r.t_ms * (1 + rng.gauss(0, 0.02)) + spike))
    fit = BatchCost.fit(records, 32, 4)
    for positions in (4, 8, 16, 40):
        truth = COST.t_target(positions, None, 300 * positions)
        assert fit.t_target(positions, None, 300 * positions) == pytest.approx(truth, rel=0.01)
    for rows in (1, 4, 8):
        assert fit.t_draft(rows) == pytest.approx(COST.t_draft(rows), rel=0.01)
    assert fit.union_decay == pytest.approx(COST.union_decay, abs=0.01)
    assert fit.r2_target > 0.99  # on the passes it kept


def test_too_few_steps_are_refused():
    with pytest.raises(ValueError, match="too few decoding steps"):
        BatchCost.fit(_records(COST, random.Random(1))[:5], 32, 4)


def test_the_calibration_job_adds_the_batch_section(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "costmodel.json"
    calibrate_batch.main(
        [
            "--limit",
            "3",
            "--batch-sizes",
            "1,3",
            "--ks",
            "0-2",
            "--max-new-tokens",
            "6",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    batch = BatchCost.from_json(data["batch"])
    assert batch.records > 0 and batch.experts == 32
    committed = json.loads(Path("models/costmodel.json").read_text())
    assert data["beta0"] == committed["beta0"]  # the batch-1 model is kept as it was


def test_plan_mixes_chain_limits_and_prices_the_batch():
    cost = BatchCost(
        b0=7.0,
        b_pos=0.08,
        b_union=0.08,
        b_ctx=0.0,
        d0=0.9,
        d_tok=0.06,
        s0=0.2,
        s_row=0.1,
        experts=32,
        top_k=4,
        union_decay=0.98,
    )
    accs = [[0.9] * 6, [0.9] * 2, [], [0.05] * 6]
    ks, rate = plan_lengths(cost, accs, [100] * 4, 6)
    assert ks[1] <= 2 and ks[2] == 0 and ks[0] >= ks[3] and ks[0] > 0
    plain = (cost.t_step_overhead(4) + cost.t_target(4, None, 400)) / 4
    assert rate < plain
    assert plan_lengths(cost, [[0.0] * 6], [10], 6)[0] == [0]
