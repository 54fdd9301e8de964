"""Our proposer inside vLLM (pipeline.vllm_spec): real vLLM (its CPU build, in its own
environment) for what it does in an engine; its own logic (rows found by their tokens, the
batch's plan, the step-cost fit, the artifact checks) directly."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.cost.batch import BatchCost
from pipeline.decode.batch_economy import plan_lengths
from pipeline.vllm_spec import config as pconfig
from pipeline.vllm_spec.contract import VllmProposer
from pipeline.vllm_spec.rows import StateTable
from pipeline.vllm_spec.step_fit import fit_step_cost
from tests.vllm_support import run_scenarios

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """tests/vllm_scenarios.py's results: one vLLM process, eight engine starts (about a minute)."""
    return run_scenarios("vllm_scenarios.py", tmp_path_factory.mktemp("vllm") / "out.json")


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["c1", "c8", "short"])
def test_greedy_text_equals_no_speculation(scenarios, cell):
    # c1: one request at a time; c8: eight prompts of different lengths in one step; short:
    # requests ending at different steps (their rows leave the batch mid-generation).
    assert scenarios[f"ours_{cell}"] == scenarios[f"plain_{cell}"]
    assert all(len(t) > 0 for t in scenarios[f"ours_{cell}"])


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["c1", "c8", "short"])
def test_cost_aware_scheduler_keeps_the_greedy_text(scenarios, cell):
    # vLLM's draft_model drafter, the draft length of each step chosen by CostAwareScheduler
    # (random on a third of the steps, so lengths 0..4 all meet the text).
    assert scenarios[f"sched_{cell}"] == scenarios[f"plain_{cell}"]


@pytest.mark.slow
def test_cost_aware_scheduler_varies_the_draft_length(scenarios):
    spec = scenarios["sched_spec"]
    drafts, tokens = spec["vllm:spec_decode_num_drafts"], spec["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0 and 1.0 < tokens / drafts < 4.0, spec  # neither always 1 nor always K
    assert 0 < spec["vllm:spec_decode_num_accepted_tokens"] <= tokens


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["c1", "c8", "short"])
def test_vllm_serves_the_eagle3_head_with_the_greedy_text(scenarios, cell):
    # vLLM's eagle3 method over the committed head (models/eagle3-head, SpecForge layout).
    assert scenarios[f"eagle3_{cell}"] == scenarios[f"plain_{cell}"]


@pytest.mark.slow
def test_the_head_drafts_accepted_tokens_in_vllm_also_under_the_scheduler(scenarios):
    assert scenarios["sched_eagle3_c8"] == scenarios["plain_c8"]
    assert scenarios["sched_eagle3_short"] == scenarios["plain_short"]
    for name in ("eagle3_spec", "sched_eagle3_spec"):
        spec = scenarios[name]
        tokens = spec["vllm:spec_decode_num_draft_tokens"]
        # A trained head: most drafted tokens are accepted (a random one accepts none).
        assert 0.3 * tokens < spec["vllm:spec_decode_num_accepted_tokens"] <= tokens, spec
    spec = scenarios["sched_eagle3_spec"]
    assert spec["vllm:spec_decode_num_draft_tokens"] / spec["vllm:spec_decode_num_drafts"] > 1.0


@pytest.mark.slow
def test_rows_reordered_and_preempted_keep_the_text(scenarios):
    assert scenarios["ours_reversed"] == scenarios["plain_c8"]
    assert scenarios["preemptions"] > 0, "the small KV cache was meant to force preemption"
    assert scenarios["preempted"] == scenarios["preempted_plain"]


@pytest.mark.slow
def test_proposer_drafts_and_counts_what_vllm_accepted(scenarios):
    stats = scenarios["ours_stats"]
    assert stats["calls"] > 50 and stats["drafted"] > 0 and stats["draft_rounds"] > 0
    assert 0 < stats["accepted"] <= stats["drafted"]
    assert stats["propose_s"] == pytest.approx(stats["draft_s"] + stats["decide_s"], rel=1e-6)


@pytest.mark.slow
def test_seeded_sampling_runs_to_length(scenarios):
    # vLLM verifies our token-id proposals with its own rejection sampler (point mass), so T > 0
    # is lossless by vLLM's rule; a seed fixes the first token (sampled before any proposal),
    # not the later ones: how many draws a step takes depends on what was proposed, which for
    # vLLM's own draft_model too differs between two identical calls (docs/vllm.md).
    for run in scenarios["ours_seeded"]:
        assert [len(t) for t in run] == [32] * 4
        assert [t[0] for t in run] == [t[0] for t in scenarios["plain_seeded"]]


@pytest.mark.slow
def test_bad_artifact_refused_at_start(scenarios):
    # The engine's core runs in the scenarios' process: what building it raised carries the
    # proposer's reason and what to run (a spawned core prints the same to its log).
    error = scenarios["bad_artifact"]
    assert error != "started"
    assert "no vLLM step cost model at /nonexistent/vllm_costmodel.json" in error
    assert "python -m jobs.calibrate_vllm" in error


# -- the proposer's own logic, no engine ---------------------------------------------------


def test_artifacts_checked_before_an_engine_starts(tmp_path):
    target = ROOT / "models" / "target"
    ok = pconfig.check(pconfig.ProposerConfig(), target)
    assert ok.cost is not None and ok.acceptance is not None
    with pytest.raises(FileNotFoundError, match="no vLLM step cost model"):
        pconfig.check(pconfig.ProposerConfig(costmodel=str(tmp_path / "none.json")), target)
    # The 2-layer draft's acceptance model with the 1-layer draft: another pair.
    wrong = pconfig.ProposerConfig(acceptance="models/draft-2layer/acceptance.json")
    with pytest.raises(ValueError, match="acceptance model"):
        pconfig.check(wrong, target)
    with pytest.raises(FileNotFoundError, match="no draft checkpoint"):
        pconfig.check(pconfig.ProposerConfig(draft=str(tmp_path)), target)
    measured = json.loads((ROOT / "models" / "vllm_costmodel.json").read_text())
    measured["provenance"]["dtype"] = "bfloat16"
    (tmp_path / "other.json").write_text(json.dumps(measured))
    with pytest.raises(ValueError, match="dtype: measured on 'bfloat16'"):
        pconfig.check(pconfig.ProposerConfig(costmodel=str(tmp_path / "other.json")), target)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"k": 1}', "unknown field"),
        ('{"design": "x"}', "design"),
        ('{"probe_every": 0}', "probe_every"),
    ],
)
def test_config_from_env_names_the_problem(text, problem):
    with pytest.raises(ValueError, match=problem):
        pconfig.ProposerConfig.from_env({pconfig.ENV: text})


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


def test_outcome_is_the_accepted_prefix():
    table = StateTable(iter(range(9)).__next__, lambda s: None)
    ((state, _),) = table.match([np.arange(5)])
    state.proposed, state.proposed_at = [7, 8, 9], 5
    assert state.outcome(np.array([0, 1, 2, 3, 4, 7, 8, 3])) == 2
    assert state.outcome(np.array([0, 1, 2, 3, 4, 1])) == 0
    assert state.outcome(np.array([0, 1, 2, 3, 4, 7, 8, 9, 4])) == 3


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


def test_step_cost_fit_recovers_known_costs():
    rng = np.random.default_rng(0)
    records = []
    for _ in range(400):
        rows = int(rng.integers(1, 17))
        positions = rows + int(rng.integers(0, 6 * rows + 1))
        union = 32 - 28 * 0.97 ** (positions - 1)
        attended = positions * int(rng.integers(20, 300))
        step = 5.0 + 0.1 * positions + 0.2 * union + 1e-4 * attended + rng.normal(0, 0.05)
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
    assert cost.d_tok == pytest.approx(0.05, abs=0.005)
    assert cost.union_decay == pytest.approx(0.97, abs=0.002)
    assert abs(fit["bias_ms"]) < 0.05
    with pytest.raises(ValueError, match="decode steps"):
        fit_step_cost(records[:5], experts=32, top_k=4)


def test_proposer_logic_without_an_engine(monkeypatch):
    """The proposer built from a vLLM-like config outside vLLM: greedy chains are the draft's
    own greedy continuation, and rows keep their states when the batch is reordered."""
    from pipeline.vllm_spec.proposer import CostAwareProposer

    monkeypatch.setenv(pconfig.ENV, json.dumps({"design": "fixed"}))
    monkeypatch.delenv("SPECBOUND_PROPOSER_STATS", raising=False)
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(
            max_model_len=256, dtype="float32", model=str(ROOT / "models" / "target")
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
    )
    proposer = CostAwareProposer(cfg)
    assert isinstance(proposer, VllmProposer)
    proposer.load_model(None)
    tokens = np.zeros((4, 256), dtype=np.int64)
    a, b = [5, 6, 7, 8, 9], [40, 41, 42]
    tokens[0, :5], tokens[1, :3] = a, b
    first = proposer.propose([[9], [42]], np.array([5, 3]), tokens)
    assert [len(c) for c in first] == [3, 3]
    # Reorder the rows: the same proposals, found from the tokens.
    swapped = tokens[[1, 0]]
    again = proposer.propose([[42], [9]], np.array([3, 5]), swapped)
    assert again == first[::-1]
    # The draft's own greedy continuation, token by token.
    import torch
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(str(ROOT / "models" / "draft")).eval()
    ids = list(a)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(draft(torch.tensor([ids])).logits[0, -1].argmax()))
    assert first[0] == ids[5:]


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
