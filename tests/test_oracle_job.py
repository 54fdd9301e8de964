"""The oracle's fan-out on extraction-shaped tables (summary rows per configuration, in-sample
and cross-fitted), the DuckDB sweep and lambda against a direct numpy computation, and the job
end to end on a small extraction made with the tiny models."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from jobs import oracle as oracle_job
from pipeline.cost.model import CostModel
from pipeline.data.prompts import load_jsonl
from pipeline.data.references import build_references
from pipeline.data.schemas import SUMMARY_SCHEMA
from pipeline.data.shards import check_manifest, write_shard
from pipeline.data.sql import run_query
from pipeline.extract.rows import extract_sequence
from pipeline.models.adapters import MoESpec
from pipeline.models.loading import load_pair
from pipeline.oracle.bellman import acceptance_table, cost_table, evaluate_policy, solve
from pipeline.oracle.fanout import OracleConfig, solve_all
from pipeline.oracle.inputs import inputs_from_tables
from tests.test_expert_union import LAYERS, TOP_K, synthetic_tables
from tests.test_extract_pipeline import FIXTURE

LMAX = 4
MODEL = CostModel(
    {m: 4.0 + 0.3 * m for m in range(1, LMAX + 2)},
    {m: 0.05 * m for m in range(1, LMAX + 2)},
    0.001,
    0.2,
    0.05,
    meta={"device": "synthetic"},
)
SPEC = MoESpec("synthetic", tuple(range(LAYERS)), 16, TOP_K, False)


def _synthetic(seed: int = 0, one_draw_seq: bool = False):
    rng = np.random.default_rng(seed)
    parts = [
        synthetic_tables(
            rng,
            f"s{j}",
            int(rng.integers(5, 12)),
            LMAX,
            category="code" if j % 2 else "prose",
            draws={"surrogate": 1 if (one_draw_seq and j == 0) else 2, "greedy": 1, "sampling": 2},
        )
        for j in range(4)
    ]
    cat = lambda j: pa.concat_tables([p[j] for p in parts])  # noqa: E731
    return cat(0), cat(1), cat(2)


def test_fanout_rows_per_configuration_and_cross_fitting():
    tables = _synthetic()
    inputs = inputs_from_tables(*tables, SPEC, LMAX)
    lmaxes = [1, 2, LMAX]
    results = solve_all(inputs, MODEL, lmaxes, LMAX, OracleConfig("sampling", True))
    for seq, res in zip(inputs, results, strict=True):
        rows = pd.DataFrame(res["summary"])
        assert len(rows) == len(lmaxes) * 3 * 2
        for row in rows.itertuples():
            sl = slice(0, row.lmax + 1)
            probs = acceptance_table(seq.acceptance(row.acceptance), row.lmax, row.plain_step)
            costs = [
                cost_table(MODEL, seq.union(row.acceptance, d), seq.prompt_len)[:, sl, sl]
                for d in seq.draws(row.acceptance)
            ]
            sols = [solve(probs, c) for c in costs]
            assert row.dp0_ms == pytest.approx(np.mean([s.dp[0] for s in sols]))
            if row.acceptance == "greedy":
                assert row.draws == 1 and row.dp0_crossfit_ms == row.dp0_ms
            else:
                want = np.mean(
                    [evaluate_policy(probs, costs[1 - d], sols[d].k_star)[0] for d in (0, 1)]
                )
                assert row.dp0_crossfit_ms == pytest.approx(want)
                assert row.speedup_crossfit == pytest.approx(row.ar_ms / want)
                # Each draw's optimum is best on its own draw: never below the in-sample cost.
                assert row.dp0_crossfit_ms >= row.dp0_ms - 1e-9
            if row.plain_step:
                assert row.speedup >= 1 - 1e-12
        dec = res["decisions"].to_pandas()
        assert set(dec["acceptance"]) == {"sampling"} and dec["plain_step"].all()
        assert dec["k"].min() == 0 and (dec.groupby("i")["chosen"].sum() == 1).all()
        chosen = dec[dec["chosen"]].set_index("i")
        assert (chosen["q_value"] <= dec.groupby("i")["q_value"].min() + 1e-12).all()


def test_sweep_and_lambda_equal_a_direct_computation(tmp_path):
    tables = _synthetic(seed=1, one_draw_seq=True)
    results = solve_all(
        inputs_from_tables(*tables, SPEC, LMAX),
        MODEL,
        [1, 2, 3, LMAX],
        3,
        OracleConfig("surrogate", True),
    )
    summary = pa.Table.from_pylist(
        [r for res in results for r in res["summary"]], schema=SUMMARY_SCHEMA
    )
    pq.write_table(summary, tmp_path / "summary.parquet")
    sweep = run_query("lmax_sweep", summary=tmp_path / "summary.parquet")
    df = summary.to_pandas()
    for cat in ("all", "code", "prose"):
        sub = df if cat == "all" else df[df["category"] == cat]
        for (lmax, acc, plain), g in sub.groupby(["lmax", "acceptance", "plain_step"]):
            got = sweep[
                (sweep["lmax"] == lmax)
                & (sweep["acceptance"] == acc)
                & (sweep["plain_step"] == plain)
                & (sweep["category"] == cat)
            ]
            assert len(got) == 1
            got = got.iloc[0]
            assert got["sequences"] == len(g)
            assert got["speedup_bound"] == pytest.approx(g["ar_ms"].sum() / g["dp0_ms"].sum())
            assert got["mean_draft_len"] == pytest.approx(
                g["visit_k_sum"].sum() / g["visit_sum"].sum()
            )
            if g["dp0_crossfit_ms"].isna().any():  # s0 has one surrogate draw
                assert acc == "surrogate" and "s0" in set(g["seq_id"])
                assert pd.isna(got["speedup_crossfit"])
            else:
                want = g["ar_ms"].sum() / g["dp0_crossfit_ms"].sum()
                assert got["speedup_crossfit"] == pytest.approx(want)

    decisions = pa.concat_tables([r["decisions"] for r in results])
    pq.write_table(decisions, tmp_path / "decisions.parquet")
    deltas = run_query("delta_space", decisions=tmp_path / "decisions.parquet")
    delta = run_query("delta_summary", deltas=deltas).iloc[0]
    d = decisions.to_pandas()
    best = d[d["chosen"]].set_index(["seq_id", "i"])
    alt = d[~d["chosen"]].join(best, on=["seq_id", "i"], rsuffix="_b")
    d_a = (alt["e_accept"] - alt["e_accept_b"]).to_numpy()
    d_c = (alt["e_cost_ms"] - alt["e_cost_ms_b"]).to_numpy()
    d_u = (alt["e_experts"] - alt["e_experts_b"]).to_numpy()
    up = d_a > 0
    assert up.sum() > 10 and delta["alternatives"] == len(alt)
    assert delta["lambda_ms"] == pytest.approx(np.quantile(d_c[up] / d_a[up], 0.01))
    assert delta["lambda_experts"] == pytest.approx(np.quantile(d_u[up] / d_a[up], 0.01))
    flat = np.abs(d_a) < 1e-12
    assert delta["flat"] == flat.sum()
    assert delta["quadrant_i"] == ((d_a > 0) & (d_c >= 0) & ~flat).sum()
    assert delta["quadrant_iii"] == ((d_a < 0) & (d_c < 0) & ~flat).sum()
    assert (alt["k"] == 0).any()  # plain-step alternatives are in delta space


@pytest.fixture(scope="module")
def extraction(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("extract")
    pair = load_pair(checkpoints.target, checkpoints.draft)
    refs = build_references(load_jsonl(FIXTURE, limit=4), pair.target, pair.tokenizer, 12)
    check_manifest(out, {"lmax": LMAX, "mode": "shared"})
    for shard, ref in enumerate(refs):
        part = extract_sequence(pair, ref, LMAX, "shared", seed=0)
        write_shard(
            out, shard, {"sequences": part.sequences, "tokens": part.tokens, "tails": part.tails}
        )
    MODEL.save(out / "costmodel.json")
    return out, pair


def test_oracle_job_writes_the_study(extraction, checkpoints, tmp_path, monkeypatch, capsys):
    extract_dir, pair = extraction
    monkeypatch.chdir(tmp_path)
    ray.init(num_cpus=2)
    try:
        oracle_job.main(
            [
                "--extract",
                str(extract_dir),
                "--costmodel",
                str(extract_dir / "costmodel.json"),
                "--target",
                str(checkpoints.target),
                "--out",
                "oracle",
            ]
        )
    finally:
        ray.shutdown()
    printed = capsys.readouterr().out
    assert "Lmax sweep" in printed and "boundary slope lambda" in printed
    header = next(line for line in printed.splitlines() if line.lstrip().startswith("Lmax  "))
    for column in (
        "greedy k>=0",
        "greedy k>=1",
        "sampling k>=0",
        "sampling k>=1",
        "surrogate k>=0",
        "surrogate k>=1",
    ):
        assert column in header
    out = tmp_path / "oracle"
    decisions = pq.read_table(out / "decisions.parquet").to_pandas()
    summary = pq.read_table(out / "summary.parquet").to_pandas()
    assert {
        "seq_id",
        "lmax",
        "acceptance",
        "plain_step",
        "i",
        "k",
        "e_accept",
        "e_cost_ms",
        "e_experts",
        "q_value",
        "chosen",
        "visit",
    } <= set(decisions.columns)
    assert set(decisions["acceptance"]) == {"surrogate"} and decisions["plain_step"].all()
    assert set(SUMMARY_SCHEMA.names) == set(summary.columns)
    assert sorted(summary["lmax"].unique()) == list(range(1, LMAX + 1))
    assert set(summary["acceptance"]) == {"surrogate", "greedy", "sampling"}
    assert (summary.loc[summary["plain_step"], "speedup"] >= 1 - 1e-12).all()
    greedy = summary[summary["acceptance"] == "greedy"]
    assert (greedy["dp0_crossfit_ms"] == greedy["dp0_ms"]).all()
    assert summary.loc[summary["acceptance"] != "greedy", "dp0_crossfit_ms"].notna().all()
    # Exactly one chosen budget per state.
    assert (decisions.groupby(["seq_id", "i"])["chosen"].sum() == 1).all()
    sweep = pd.read_csv(out / "lmax_sweep.csv")
    for _, g in sweep[sweep["category"] == "all"].groupby(["acceptance", "plain_step"]):
        bound = g.sort_values("lmax")["speedup_bound"].to_numpy()
        assert (bound[1:] >= bound[:-1] - 1e-12).all()
    policy = json.loads((out / "policy.json").read_text())
    assert policy["lmax"] == LMAX and policy["acceptance"] == "surrogate"
    assert policy["plain_step"] is True
    assert (out / "lmax_sweep.png").is_file() and (out / "delta_space.png").is_file()
    classes = pd.read_csv(out / "context_classes.csv")
    assert classes["states"].sum() == len(decisions[decisions["chosen"]])


def test_oracle_job_selects_the_papers_configuration(extraction, checkpoints, tmp_path):
    extract_dir, _ = extraction
    oracle_job.main(
        [
            "--extract",
            str(extract_dir),
            "--costmodel",
            str(extract_dir / "costmodel.json"),
            "--target",
            str(checkpoints.target),
            "--acceptance",
            "greedy",
            "--no-plain-step",
            "--lmax",
            "1-2",
            "--out",
            str(tmp_path),
        ]
    )
    decisions = pq.read_table(tmp_path / "decisions.parquet").to_pandas()
    assert set(decisions["acceptance"]) == {"greedy"} and not decisions["plain_step"].any()
    assert decisions["k"].min() == 1 and set(decisions["lmax"]) == {2}


def test_oracle_job_rejects_a_sweep_beyond_the_extraction(extraction, checkpoints, tmp_path):
    extract_dir, _ = extraction
    with pytest.raises(ValueError, match="must lie in 1..4"):
        oracle_job.main(
            [
                "--extract",
                str(extract_dir),
                "--costmodel",
                str(extract_dir / "costmodel.json"),
                "--lmax",
                "1-6",
                "--out",
                str(tmp_path),
            ]
        )


def test_oracle_job_refuses_a_cost_model_measured_on_other_settings(extraction, tmp_path):
    """The bound prices the extraction's routing with the cost model: one measured with another
    experts implementation is refused before any work, naming the field and the override."""
    extract_dir, _ = extraction
    shutil.copytree(extract_dir, tmp_path / "extract")
    manifest = json.loads((tmp_path / "extract" / "manifest.json").read_text())
    manifest["experts_implementation"] = "grouped_mm"
    (tmp_path / "extract" / "manifest.json").write_text(json.dumps(manifest))
    model = CostModel(
        MODEL.beta0,
        MODEL.alpha,
        MODEL.c,
        MODEL.draft_a,
        MODEL.draft_b,
        meta={"experts_implementation": "eager"},
    )
    model.save(tmp_path / "costmodel.json")
    args = [
        "--extract",
        str(tmp_path / "extract"),
        "--costmodel",
        str(tmp_path / "costmodel.json"),
        "--out",
        str(tmp_path / "oracle"),
    ]
    with pytest.raises(ValueError, match="experts_implementation") as err:
        oracle_job.main(args)
    assert "--allow-costmodel-mismatch" in str(err.value)
    assert not (tmp_path / "oracle").exists()
