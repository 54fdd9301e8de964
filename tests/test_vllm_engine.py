"""The project's parts inside a real vLLM engine (its CPU build, in its own environment): the
cost-aware scheduler over vLLM's draft_model and EAGLE-3 drafters keeps the greedy text,
whatever the rows do (reordered, preempted, finishing mid-batch), and requests choose their
speculation; the calibration's drafter and step-cost fit on their own logic."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.vllm_spec import calibration_drafter as calib
from pipeline.vllm_spec.contract import CustomClassDrafter
from pipeline.vllm_spec.rows import StateTable
from pipeline.vllm_spec.step_fit import fit_step_cost, read_records
from tests.vllm_support import run_scenarios

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """tests/vllm_scenarios.py's results: one vLLM process, eight engine starts (about a minute)."""
    return run_scenarios("vllm_scenarios.py", tmp_path_factory.mktemp("vllm") / "out.json")


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["c1", "c8", "short"])
def test_cost_aware_scheduler_keeps_the_greedy_text(scenarios, cell):
    # c1: one request at a time; c8: eight prompts of different lengths in one step; short:
    # requests ending at different steps (their rows leave the batch mid-generation).
    # vLLM's draft_model drafter, the draft length of each step chosen by CostAwareScheduler
    # (random on a third of the steps, so lengths 0..4 all meet the text).
    assert scenarios[f"sched_{cell}"] == scenarios[f"plain_{cell}"]


@pytest.mark.slow
def test_cost_aware_scheduler_varies_the_draft_length(scenarios):
    spec = scenarios["sched_spec"]
    drafts, tokens = spec["vllm:spec_decode_num_drafts"], spec["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0 and 1.0 < tokens / drafts < 4.0, spec  # neither always 1 nor always K
    assert 0 < spec["vllm:spec_decode_num_accepted_tokens"] <= tokens
    # A drafting step after steps at 0 also catches the draft up, and a step at 0 after
    # drafting still verifies drafts on vLLM's speculative path: timed, but not fitted as a
    # step of their k (nor is a step with a prefill, nor one in which a request ended or
    # arrived: every request of these runs ends in one).
    steps = scenarios["sched_steps"]
    assert steps["chosen"][0] > 0 and steps["catch_up"] > 0 and steps["churn"] > 0
    assert steps["wind_down"] > 0
    switches = steps["catch_up"] + steps["wind_down"]
    assert switches + steps["churn"] <= steps["unfitted"] < steps["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["c1", "c8", "short"])
def test_vllm_serves_the_eagle3_head_with_the_greedy_text(scenarios, cell):
    # vLLM's eagle3 method over the committed head (models/eagle3-head, SpecForge layout).
    assert scenarios[f"eagle3_{cell}"] == scenarios[f"plain_{cell}"]


@pytest.mark.slow
def test_the_head_drafts_accepted_tokens_in_vllm_also_under_the_scheduler(scenarios):
    # Greedy text equal also through the A/B check's held epochs (tests/vllm_scenarios.py).
    assert scenarios["sched_eagle3_c8"] == scenarios["plain_c8"]
    assert scenarios["sched_eagle3_short"] == scenarios["plain_short"]
    for name in ("eagle3_spec", "sched_eagle3_spec"):
        spec = scenarios[name]
        tokens = spec["vllm:spec_decode_num_draft_tokens"]
        # A trained head: most drafted tokens are accepted (a random one accepts none).
        assert 0.3 * tokens < spec["vllm:spec_decode_num_accepted_tokens"] <= tokens, spec
    spec = scenarios["sched_eagle3_spec"]
    assert spec["vllm:spec_decode_num_draft_tokens"] / spec["vllm:spec_decode_num_drafts"] > 1.0
    # That engine ran the A/B check: epochs of the policy, held at 0 and held at 2.
    assert all(n > 0 for n in scenarios["sched_eagle3_ab_epochs"].values())


@pytest.mark.slow
def test_rows_reordered_and_preempted_keep_the_text(scenarios):
    assert scenarios["sched_reversed"] == scenarios["plain_c8"]
    assert scenarios["preemptions"] > 0, "the small KV cache was meant to force preemption"
    assert scenarios["preempted"] == scenarios["preempted_plain"]


@pytest.mark.slow
def test_the_calibration_drafter_records_every_step_in_vllm(scenarios):
    """jobs.calibrate_vllm's vLLM side: random lengths 0..4 per row, every decode step
    recorded with the experts its pass routed (a hook on vLLM's MoE gates), and the records
    fit."""
    records = read_records(Path(scenarios["calibration_records"]))
    config = json.loads((ROOT / "models" / "target" / "config.json").read_text())
    experts, top_k = config["num_local_experts"], config["num_experts_per_tok"]
    assert len(records) > 100
    assert all(r["step_ms"] > 0 and r["positions"] >= r["rows"] for r in records)
    drafted = {r["positions"] - r["rows"] for r in records if r["rows"] == 1}
    assert drafted == {0, 1, 2, 3, 4}  # one row: each length of the design
    assert {r["rows"] for r in records} >= {1, 4}
    routed = [r for r in records if r.get("hook_positions")]
    assert routed and all(top_k <= r["union"] <= experts for r in routed)
    cost, fit = fit_step_cost(records, experts=experts, top_k=top_k)
    assert cost.b0 > 0 and cost.d0 > 0 and fit


# -- the calibration drafter's own logic, no engine ----------------------------------------


def test_bench_methods_alternate_cell_by_cell_on_engines_that_stay_up(scenarios):
    run = scenarios["bench_by_cells"]
    results, progress = run["results"], run["progress"]
    assert results["interleave"] == "cells"
    # Each engine started once, then every (repeat, cell) ran every method, the order flipped
    # from cell to cell and, for a cell, from repeat to repeat.
    assert [line for line in progress if "starting vLLM" in line] == [
        "none: starting vLLM",
        "dm2: starting vLLM",
    ]
    ran = [line.split(":")[0] for line in progress if "tok/s" in line]
    assert ran == [
        f"repeat {rep}/2  {name}"
        for rep, firsts in ((1, ("none", "dm2")), (2, ("dm2", "none")))
        for order in (firsts, firsts[::-1])
        for name in order
    ]
    runs = {(r["repeat"], r["method"]): r for r in results["runs"]}
    assert set(runs) == {(rep, m) for rep in (0, 1) for m in ("none", "dm2")}
    for r in runs.values():
        assert r["error"] is None and [c["concurrency"] for c in r["cells"]] == [1, 2]
        assert all(c["tokens"] == 24 for c in r["cells"])
    # One start per engine, recorded in each of its runs; greedy text the same for both.
    assert runs[(0, "dm2")]["start_s"] == runs[(1, "dm2")]["start_s"] > 0
    for key in runs:
        assert [c["outputs"] for c in runs[key]["cells"]] == [
            c["outputs"] for c in runs[(0, "none")]["cells"]
        ]
    assert runs[(1, "dm2")]["cells"][0]["spec"]["drafts"] > 0


def test_draft_checked_before_an_engine_starts(tmp_path):
    target = ROOT / "models" / "target"
    assert calib.check_draft(calib.CalibrationConfig(), target) == ROOT / "models" / "draft"
    with pytest.raises(FileNotFoundError, match="no draft checkpoint"):
        calib.check_draft(calib.CalibrationConfig(draft=str(tmp_path)), target)
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((ROOT / "models" / "draft" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 7}))
    with pytest.raises(ValueError, match="must share its target's tokenizer"):
        calib.check_draft(calib.CalibrationConfig(draft=str(other)), target)


@pytest.mark.parametrize(
    ("text", "problem"),
    [("{", "not JSON"), ("[1]", "JSON object"), ('{"k": 1}', "unknown field")],
)
def test_config_from_env_names_the_problem(text, problem):
    with pytest.raises(ValueError, match=problem):
        calib.CalibrationConfig.from_env({calib.ENV: text})


def test_calibration_drafter_without_an_engine(monkeypatch, tmp_path):
    """Built from a vLLM-like config outside vLLM: each row drafts a random length of the
    draft's own greedy continuation, rows keep their states when the batch is reordered, and
    every step after the first is recorded."""
    import torch
    from transformers import AutoModelForCausalLM

    record = tmp_path / "steps.jsonl"
    monkeypatch.setenv(calib.ENV, calib.CalibrationConfig(record=str(record), seed=3).to_env())
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(max_model_len=256, model=str(ROOT / "models" / "target")),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
    )
    drafter = calib.CalibrationDrafter(cfg)
    assert isinstance(drafter, CustomClassDrafter)
    drafter.load_model(None)
    tokens = np.zeros((4, 256), dtype=np.int64)
    a, b = [5, 6, 7, 8, 9], [40, 41, 42]
    tokens[0, :5], tokens[1, :3] = a, b
    draft = AutoModelForCausalLM.from_pretrained(str(ROOT / "models" / "draft")).eval()

    def greedy(ids: list[int], n: int) -> list[int]:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(draft(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-n:] if n else []

    lengths = []
    for step in range(6):
        order = [0, 1] if step % 2 == 0 else [1, 0]  # reordered rows every other step
        rows = tokens[order]
        lens = np.array([5, 3])[order]
        last = [[int(rows[i, lens[i] - 1])] for i in range(2)]
        chains = drafter.propose(last, lens, rows)
        for i, chain in enumerate(chains):
            assert len(chain) <= 3
            assert chain == greedy(rows[i, : lens[i]].tolist(), len(chain))
            lengths.append(len(chain))
    assert len(set(lengths)) > 1  # random lengths, not one K
    drafter.flush()
    records = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(records) == 5 and all(r["rows"] == 2 and r["step_ms"] > 0 for r in records)


def test_states_found_by_tokens_whatever_the_order():
    slots = iter(range(100))
    released: list[int] = []
    table = StateTable(lambda: next(slots), released.append)
    a, b = np.arange(10, 30), np.arange(50, 70)
    (sa, _), (sb, _) = table.match([a, b])
    sa.cached, sb.cached = a, b
    # Reordered rows, each text grown by a token: the same states, their whole cache kept.
    (rb, kb), (ra, ka) = table.match([np.append(b, 1), np.append(a, 2)])
    assert (rb, ra) == (sb, sa) and (kb, ka) == (len(b), len(a))
    # Two requests with one prompt get two states; a changed text keeps the common prefix.
    (x, _), (y, _) = table.match([a[:12], a[:12]])
    assert x is not y
    sa.cached = a
    ((z, keep),) = table.match([np.concatenate([a[:15], [999, 998]])])
    assert z is sa and keep == 15
    for _ in range(100):
        table.match([np.arange(200, 210)])
    assert {sa.slot, sb.slot} <= set(released)


def test_step_cost_fit_recovers_known_costs():
    rng = np.random.default_rng(0)
    records = []
    for _ in range(400):
        rows = int(rng.integers(1, 17))
        positions = rows + int(rng.integers(0, 6 * rows + 1))
        union = 32 - 28 * 0.97 ** (positions - 1)
        attended = positions * int(rng.integers(20, 300))
        step = 5.0 + 0.1 * positions + 0.2 * union + 1e-4 * attended + 0.3 * rows
        step += rng.normal(0, 0.05)
        forwards = [[rows, n, 0.8 + 0.05 * n + rng.normal(0, 0.01)] for n in (rows, rows)]
        records.append(
            {
                "rows": rows,
                "positions": positions,
                "hook_positions": positions,
                "union": union,
                "attended": attended,
                "step_ms": step,
                "propose_ms": 2.0 + 0.3 * rows,
                "draft_ms": 1.8 + 0.2 * rows,
                "draft_forwards": forwards,
            }
        )
    cost, fit = fit_step_cost(records, experts=32, top_k=4)
    assert cost.b_pos == pytest.approx(0.1, abs=0.02)
    assert cost.b_union == pytest.approx(0.2, abs=0.03)
    assert cost.b_row == pytest.approx(0.3, abs=0.02)
    assert cost.d_tok == pytest.approx(0.05, abs=0.005)
    assert cost.union_decay == pytest.approx(0.97, abs=0.002)
    assert abs(fit["bias_ms"]) < 0.05
    with pytest.raises(ValueError, match="decode steps"):
        fit_step_cost(records[:5], experts=32, top_k=4)


def test_requests_choose_their_speculation_and_seeds_repeat(scenarios):
    """vllm_xargs speculation off / max_draft_tokens honoured row by row; a seeded T = 1 request
    under the cost-aware scheduler with probabilistic drafting gives the text it gives without
    speculation (12 seeds, 64 tokens), so it repeats."""
    plain, ours = scenarios["plain_mixed"], scenarios["args_mixed"]
    assert ours[:12] == plain[:12]
    assert ours[12:] == plain[12:]  # greedy: drafting, off, capped
    assert scenarios["args_held_off"] > 0
    assert sum(scenarios["args_chosen"][1:]) > 0  # the greedy rows drafted
    before, after = scenarios["args_off_c1_spec"]
    drafts = "vllm:spec_decode_num_drafts"
    assert after.get(drafts, 0) == before.get(drafts, 0)  # one request off: no draft at all
    assert scenarios["args_off_c1"][0] == scenarios["plain_c1"][0][:48]
