"""Designed calibration (routing forced to every union size U at every m): the passes compute
exactly the experts the design sets, the cells cover the feasible range, the fit on cell
medians recovers known coefficients, the designed model is scored on observational rounds, and
`jobs.calibrate --design forced` writes both designs side by side.

As in test_calibrate.py, no assertion depends on how fast or busy this machine is: real
timings are checked for shape and sanity; what the fit guarantees is checked on times
synthesised from known coefficients over the real design."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import DynamicCache

from pipeline.cost.design_stats import (
    beta0_monotone,
    cell_dispersion,
    cell_medians,
    error_on,
    heldout_summary,
)
from pipeline.cost.designed import InSituDesign, designed_pass, union_levels
from pipeline.cost.designed_contexts import (
    collect_designed_rounds,
    context_ids,
    prompt_contexts,
    random_contexts,
)
from pipeline.cost.fit import fit_cost_model
from pipeline.cost.model import CostModel
from pipeline.cost.rounds import collect_rounds
from pipeline.data.prompts import Prompt
from pipeline.data.schemas import ROUNDS_SCHEMA
from pipeline.models.forced_routing import ForcedRouting, feasible_unions
from pipeline.models.loading import REPO_ROOT, load_pair
from pipeline.models.routing import RoutingCapture
from tests.conftest import TEXTS

PROMPTS = [Prompt(f"p{i}", "code", TEXTS[i].text, "test") for i in range(3)]


@pytest.fixture(scope="module")
def pair(checkpoints):
    return load_pair(checkpoints.target, checkpoints.draft, "cpu", "float32")


def test_union_levels_span_the_feasible_range():
    assert union_levels(4, 2, 8, 8) == list(feasible_unions(4, 2, 8)) == [2, 3, 4, 5, 6, 7, 8]
    levels = union_levels(13, 4, 32, 5)
    assert levels[0] == 4 and levels[-1] == 32 and len(levels) == 5
    assert union_levels(1, 4, 32, 8) == [4]  # one position: the union is its top_k


def test_a_designed_pass_computes_exactly_the_forced_union(pair):
    spec = pair.spec
    gen = torch.Generator().manual_seed(0)
    ids = pair.tokenizer(TEXTS[0].text, add_special_tokens=False)["input_ids"][:24]
    cache = DynamicCache(config=pair.target.config)
    vocab = int(pair.target.config.vocab_size)
    with torch.no_grad():
        pair.target(torch.tensor([ids[:-1]]), past_key_values=cache, use_cache=True)
        with ForcedRouting(pair.target, spec) as forced, RoutingCapture(pair.target, spec) as cap:
            for m in (1, 2, 3):
                for u in feasible_unions(m, spec.top_k, spec.num_experts):
                    t_ms = designed_pass(
                        pair.target, spec, forced, cache, len(ids) - 1, ids[-1], m, u, gen, vocab
                    )
                    routing = cap.take(1, m)[0]  # [m, layers, top_k]
                    for layer in range(spec.num_moe_layers):
                        assert len(torch.unique(routing[:, layer])) == u, (m, u, layer)
                    assert t_ms > 0
                    assert cache.get_seq_length() == len(ids) - 1  # rolled back


def test_collected_cells_cover_every_m_and_level(pair):
    contexts = prompt_contexts(pair.tokenizer, PROMPTS)
    table = collect_designed_rounds(
        pair.target, pair.spec, contexts, [1, 2, 3], repeats=2, max_levels=3, log=lambda _: None
    )
    assert table.schema.equals(ROUNDS_SCHEMA)
    df = table.to_pandas()
    spec = pair.spec
    cells = {(m, u) for m in (1, 2, 3) for u in union_levels(m, spec.top_k, spec.num_experts, 3)}
    assert set(zip(df["m"], df["u_bar"].astype(int), strict=True)) == cells
    assert len(df) == len(PROMPTS) * len(cells) * 2
    assert (df["draft_forwards"] == 0).all() and (df["t_target_ms"] > 0).all()
    assert df.groupby("gen_id")["m"].nunique().max() == 1  # a group is one (prompt, m)
    medians = cell_medians(df)
    assert len(medians) == len(PROMPTS) * len(cells) and (medians["repeats"] == 2).all()
    spread = cell_dispersion(df)
    assert len(spread) == len(cells) and (spread["rel_mad_pct"] >= 0).all()


def test_random_contexts_need_no_tokenizer(pair):
    contexts = random_contexts(int(pair.target.config.vocab_size), [8, 20], per_length=2)
    assert [len(c.ids) for c in contexts] == [8, 8, 20, 20]
    assert contexts[0].ids != contexts[1].ids and contexts[0].category == "random"
    df = collect_designed_rounds(
        pair.target, pair.spec, contexts, [2], repeats=1, max_levels=2, log=lambda _: None
    ).to_pandas()
    assert sorted(df["ctx_len"].unique()) == [8, 20] and len(df) == 4 * 2
    with pytest.raises(ValueError, match="lengths >= 2"):
        random_contexts(100, [1])


def test_in_situ_passes_run_at_the_rounds_state_and_leave_the_rounds_alone(pair):
    """One designed pass after every round, at that round's context, cells cycled in
    shuffled blocks; the rounds themselves (tokens, accepted counts) are what they are
    without the passes, since every pass rolls the target cache back."""
    kwargs = {"ks": [0, 2], "max_new_tokens": 10, "warmup_tokens": 2, "log": lambda _: None}
    plain = collect_rounds(pair, PROMPTS[:2], **kwargs).to_pandas()
    design = InSituDesign(pair.spec, [1, 2, 3], max_levels=3, repeats=2, per_round=1)
    rounds = collect_rounds(pair, PROMPTS[:2], observer=design, **kwargs).to_pandas()
    cols = ["gen_id", "k", "ctx_len", "u_bar", "accepted"]
    pd.testing.assert_frame_equal(plain[cols], rounds[cols])
    df = design.table().to_pandas()
    assert len(df) == len(rounds)
    assert list(df["ctx_len"]) == list(rounds["ctx_len"] + rounds["accepted"] + 1)
    assert (df["draft_forwards"] == 0).all() and (df["t_target_ms"] > 0).all()
    first_block = set(
        zip(df["m"][: len(design.cells)], df["u_bar"][: len(design.cells)], strict=True)
    )
    assert first_block == {(m, float(u)) for m, u in design.cells}  # every cell once per block
    assert set(df["gen_id"].str.rsplit("|", n=1).str[0]) == set(rounds["gen_id"])
    with pytest.raises(ValueError, match="per_round >= 1"):
        InSituDesign(pair.spec, [2], per_round=0)


def _synthetic(rng: np.random.Generator) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Designed passes and observational rounds timed by known coefficients plus noise."""
    truth = {"beta0": {m: 5.0 + 0.2 * m for m in range(1, 6)}, "alpha": 0.6, "c": 0.002}

    def price(m, u, ctx):
        return truth["beta0"][m] + (truth["alpha"] * u if m > 1 else 0.0) + truth["c"] * ctx

    rows = []
    for p in range(6):
        ctx = 40 + 30 * p
        for m in range(1, 6):
            for u in union_levels(m, 4, 32, 6):
                for r in range(5):
                    t = price(m, u, ctx) * rng.lognormal(0, 0.05)
                    rows.append(
                        {
                            "gen_id": f"p{p}|m{m}",
                            "category": "c",
                            "k": m - 1,
                            "m": m,
                            "u_bar": float(u),
                            "ctx_len": ctx,
                            "kv_tokens": ctx - 1,
                            "kv_occupancy": 0.0,
                            "accepted": 0,
                            "round": r,
                            "draft_forwards": 0,
                            "t_draft_ms": 0.0,
                            "t_target_ms": t,
                        }
                    )
    obs = []
    for g in range(8):
        m = g % 5 + 1
        for r in range(20):
            u = float(rng.uniform(4, min(4 * m, 32))) if m > 1 else 4.0
            ctx = 50 + r
            obs.append(
                {
                    "gen_id": f"g{g}",
                    "category": "c",
                    "k": m - 1,
                    "m": m,
                    "u_bar": u,
                    "ctx_len": ctx,
                    "kv_tokens": ctx - 1,
                    "kv_occupancy": 0.0,
                    "accepted": 0,
                    "round": r,
                    "draft_forwards": m - 1,
                    "t_draft_ms": 0.5 + 1.2 * (m - 1) * rng.lognormal(0, 0.03),
                    "t_target_ms": price(m, u, ctx) * rng.lognormal(0, 0.05),
                }
            )
    return pd.DataFrame(rows), pd.DataFrame(obs), truth


def test_contexts_of_set_lengths_end_with_their_prompt(pair):
    prompts = [[1, 2, 3], [4, 5], [6]]
    assert context_ids(prompts, 0, 2) == [2, 3]
    assert context_ids(prompts, 1, 6) == [6, 1, 2, 3, 4, 5]  # the others, then the prompt
    assert context_ids(prompts, 2, 9) == [3, 4, 5, 1, 2, 3, 4, 5, 6]  # cycled
    assert context_ids([[7, 8]], 0, 5) == [8, 7, 8, 7, 8]
    contexts = prompt_contexts(pair.tokenizer, PROMPTS[:2], [12, 40])
    table = collect_designed_rounds(
        pair.target, pair.spec, contexts, [1, 2], repeats=1, max_levels=2, log=lambda _: None
    )
    df = table.to_pandas()
    assert sorted(df["ctx_len"].unique()) == [12, 40]
    assert df.groupby("gen_id")["ctx_len"].nunique().max() == 1
    assert len(df) == 2 * 2 * sum(
        len(union_levels(m, pair.spec.top_k, pair.spec.num_experts, 2)) for m in (1, 2)
    )


def test_the_fit_on_cell_medians_recovers_the_coefficients_and_prices_observed_rounds():
    designed, observed, truth = _synthetic(np.random.default_rng(0))
    fit = fit_cost_model(cell_medians(designed), {}, draft_rounds=observed)
    for m in range(2, 6):
        assert fit.model.alpha[m] == pytest.approx(truth["alpha"], abs=0.05), m
    assert fit.model.draft_a == pytest.approx(1.2, abs=0.1)  # from the observational rounds
    assert (fit.per_m.loc[fit.per_m["m"] >= 2, "oos_r2"] > 0.9).all()
    held = error_on(fit.model, observed)
    assert list(held["m"]) == [1, 2, 3, 4, 5, "all"]
    assert held.iloc[-1]["mape"] < 8  # 5% multiplicative noise on the observed rounds
    assert beta0_monotone(fit.per_m) == []
    summary = heldout_summary(fit.model, observed)
    assert summary["rounds"] == len(observed) and summary["generations"] == 8
    assert abs(summary["bias_pct"]) < 2  # unbiased: the noise is centred
    # Independent per-round noise averages out over a generation's 20 rounds.
    assert summary["generation_total_mape_pct"] < summary["mape_pct"] / 2


def test_beta0_monotone_names_a_drop_beyond_the_intervals():
    per_m = pd.DataFrame({"m": [2, 3, 4], "beta0": [6.0, 5.0, 6.5], "beta0_se": [0.1, 0.1, 0.1]})
    (problem,) = beta0_monotone(per_m)
    assert "beta0(3)" in problem and "beta0(2)" in problem
    assert beta0_monotone(per_m.assign(beta0_se=1.0)) == []  # within the intervals


def _run_calibrate(tmp_path, args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", "jobs.calibrate", *args.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


DESIGNED_FILES = (
    "costmodel.json",
    "costmodel_observational.json",
    "designed_rounds.parquet",
    "cells.csv",
    "design_comparison.csv",
    "rounds.parquet",
)


@pytest.mark.slow
@pytest.mark.parametrize("design", ["forced", "forced-contexts"])
def test_calibrate_job_with_a_forced_design(tmp_path, design):
    args = (
        f"--design {design} --limit 3 --ks 0,1,3 --look-ks none --max-new-tokens 16 "
        "--designed-repeats 2 --max-levels 3 --threads 1 --device cpu --out cal"
    )
    sampled = design == "forced"  # one design's rounds greedy and sampled, the other's greedy
    args += " --temperatures 0,1 --top-p 0.9" if sampled else ""
    proc = _run_calibrate(tmp_path, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "designs side by side" in proc.stdout and "noise left per (m, U) cell" in proc.stdout
    out = tmp_path / "cal"
    for name in DESIGNED_FILES:
        assert (out / name).is_file(), name
    data = json.loads((out / "costmodel.json").read_text())
    assert data["design"] == design and data["torch_threads"] == 1
    assert data["sampling"] == {"temperature": 0.0, "top_p": 1.0}  # the file's own line
    modes = [(e["temperature"], e["top_p"]) for e in data["modes"]]
    assert modes == ([(0.0, 1.0), (1.0, 0.9)] if sampled else [(0.0, 1.0)])
    assert "prices per decoding mode" in proc.stdout
    assert ("T=1 top-p 0.9" in proc.stdout) == sampled
    model = CostModel.from_json(data)
    greedy = data["modes"][0]["draft"]  # the first mode's line is the file's own
    assert (greedy["a"], greedy["b"]) == (model.draft_a, model.draft_b)
    priced = model.for_sampling(1.0, 0.9)
    assert (priced is model) != sampled  # greedy only: a sampled generation priced as is
    if sampled:
        assert priced.draft_a == data["modes"][-1]["draft"]["a"]
    if design == "forced":  # in situ: a pass after every round, at the round's repeats
        assert data["designed_per_round"] == 1 and data["timing_repeats"] == 1
        designed = pd.read_parquet(out / "designed_rounds.parquet")
        assert len(designed) == len(pd.read_parquet(out / "rounds.parquet"))
    else:
        assert data["designed_statistic"] == "cell median"
    assert json.loads((out / "costmodel_observational.json").read_text())["design"] == (
        "observational"
    )
    comparison = pd.read_csv(out / "design_comparison.csv")
    assert list(comparison["m"]) == [1, 2, 4]
    assert {"alpha_forced", "alpha_observational", "heldout_mape"} <= set(comparison.columns)


def test_the_committed_cost_model_comes_from_the_designed_calibration():
    """models/costmodel.json: measured in situ with forced routing, one timing per pass, one
    thread; a positive per-expert and context cost and beta0(m) monotone within its
    intervals; it priced the rounds it was not fitted on without a material bias."""
    data = json.loads((REPO_ROOT / "models" / "costmodel.json").read_text())
    model = CostModel.from_json(data)
    assert data["design"] == "forced" and data["designed_per_round"] >= 1
    assert data["timing_repeats"] == 1 and data["torch_threads"] == 1
    assert all(model.alpha[m] > 0 for m in model.alpha if m >= 2) and model.c >= 0
    per_m = pd.DataFrame(
        [{"m": int(m), "beta0": model.beta0[int(m)], **q} for m, q in data["fit"]["per_m"].items()]
    )
    assert beta0_monotone(per_m) == []
    held = data["fit"]["on_observational_rounds"]
    assert abs(held["bias_pct"]) < 3 and held["rounds"] > 1000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--ks 0-3 --designed-ms 1-3", "must include K + 1 for every K of --ks: add [4]"),
        ("--repeats 0", "--repeats must be >= 1"),
        ("--designed-per-round 0", "--designed-per-round must be >= 1"),
        ("--threads 0", "--threads must be >= 1"),
        ("--temperatures 0,-1", "--temperatures must be >= 0"),
        ("--temperatures 1,1", "--temperatures: each mode once"),
        ("--temperatures 0,hot", "is not a comma-separated list of temperatures"),
        ("--temperature 1 --top-p 0", "--top-p must be in (0, 1]"),
        ("--top-p 0.9", "--top-p needs a temperature > 0"),
        ("--temperatures 0,1 --repeats 3", "--repeats > 1 needs greedy rounds"),
    ],
)
def test_calibrate_refuses_flags_that_would_fail_after_the_timing(argv, message, capsys):
    from jobs.calibrate import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv.split())
    assert message in capsys.readouterr().err


def test_a_jobs_torch_threads_do_not_leak_into_its_caller():
    from jobs.cli import torch_threads

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("the job failed")
    assert torch.get_num_threads() == before
    with torch_threads(None):  # unset: left as it is
        assert torch.get_num_threads() == before
