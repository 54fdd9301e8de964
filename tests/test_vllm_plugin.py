"""The project's vLLM plugin (pipeline.vllm_spec.plugin) in real vLLM (its CPU build, the
plugin installed by make vllm-env): a draft that skips steps proposes what a draft that never
skipped proposes, sampled speculation accepts what the math says, a wrong vLLM is refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.vllm_spec.env import engine_env, vllm_python
from pipeline.vllm_spec.plugin import check_version, parts
from tests.vllm_support import run_scenarios

ROOT = Path(__file__).resolve().parents[1]


def _vllm_python() -> Path:
    try:
        return vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (make test builds it)")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(_vllm_python()), "-c", code],
        env=engine_env() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """tests/vllm_plugin_scenarios.py's results (one process, a dozen engine starts)."""
    return run_scenarios("vllm_plugin_scenarios.py", tmp_path_factory.mktemp("plugin") / "o.json")


def _compare(scenarios, name: str, tag: str = "") -> tuple[int, int]:
    never, other = scenarios[f"{tag}never_skipped"]["proposals"], scenarios[name]["proposals"]
    common = sorted(set(never) & set(other))
    return len(common), sum(never[key] != other[key] for key in common)


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["", "head_"], ids=["draft_model", "eagle3_head"])
@pytest.mark.parametrize("kind", ["skipped", "skipped_flushing"])
def test_a_draft_that_skips_steps_proposes_what_one_that_never_skipped_does(scenarios, tag, kind):
    run = tag + kind
    stats = scenarios[run]["stats"]
    assert stats["skipped"] > 0.5 * stats["steps"]  # stretches of 1-20 skipped steps
    # Most skipped steps ran as steps without speculation; those that start a request (on a
    # prefix cache) on vLLM's path.
    assert 0.5 * stats["skipped"] < stats["plain"] < stats["skipped"]
    assert stats["caught_up"] > 0
    common, differ = _compare(scenarios, run, tag)
    assert common >= 20, "too few proposals at the same committed text to compare"
    assert differ == 0
    assert scenarios[run]["text"] == scenarios["plain"]
    if kind == "skipped_flushing":
        assert stats["flushed"] > 0  # a full backlog ran the forward at k = 0


@pytest.mark.slow
def test_a_request_on_a_cached_prefix_the_draft_skipped_proposes_as_if_it_had_not(scenarios):
    """vLLM's prefix cache holds the draft's KV with the target's: blocks written while the
    draft skipped hold none, and a later request hitting them is caught up from the first
    stale block (proposals equal to the same request computing its prefix itself); without
    that check it drafts from the stale KV (the comparison has power)."""
    runs = scenarios["cached_prefix"]
    assert runs["prefix_hits"] >= 2 * 7 * 32  # both later requests hit the held prefix
    for check in (True, False):
        ours, reference = runs[f"check_{check}"], runs[f"reference_{check}"]
        common = sorted(set(ours) & set(reference))
        assert len(common) >= 8, "too few proposals at the same committed text to compare"
        differ = sum(ours[key] != reference[key] for key in common)
        assert (differ == 0) if check else (differ > 0)


@pytest.mark.slow
def test_a_catch_up_that_does_not_fit_beside_a_prefill_chunk_waits_instead_of_overflowing(
    scenarios,
):
    """Rows with missed tokens beside a long prompt's prefill chunks in drafting steps: the
    first pass stays within the drafter's token buffers (writing past them corrupted the
    worker's heap and killed the engine); the rows left behind catch up later."""
    crowded = scenarios["crowded"]
    assert crowded["stats"]["deferred"] > 0
    assert crowded["stats"]["caught_up"] > 0
    # Greedy: each of the seven is the first 64 tokens of its text without speculation.
    assert [crowded["text"][str(i)] for i in range(7)] == [t[:64] for t in scenarios["plain"][:7]]
    assert len(crowded["text"]["long"]) == 64


@pytest.mark.slow
def test_an_engine_that_drafts_nothing_samples_as_one_without_speculation(scenarios):
    """At k = 0 the runner samples with vLLM's plain sampler: a seeded T = 1 request gives
    the text it gives with no speculation at all."""
    assert scenarios["off_seeded"] == scenarios["plain_seeded"]
    assert not scenarios["off_spec"].get("vllm:spec_decode_num_drafts")


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["", "head_"], ids=["draft_model", "eagle3_head"])
def test_skipping_without_catching_up_would_be_caught(scenarios, tag):
    """The comparison above has power: the same skips without the catch-up draft from a stale
    KV cache and propose other tokens (the text stays greedy: vLLM verifies every token)."""
    common, differ = _compare(scenarios, f"{tag}skipped_stale", tag)
    assert common >= 20 and differ > 0
    assert scenarios[f"{tag}skipped_stale"]["text"] == scenarios["plain"]


def _kept(proposal: list[int]) -> int:
    return next((j for j, t in enumerate(proposal) if t < 0), len(proposal))


@pytest.mark.slow
def test_the_acceptance_stop_proposes_prefixes_of_full_chains_and_keeps_greedy_text(scenarios):
    """The drafter's acceptance stop (K = 8, stop_below 0.3) proposes, at each committed text,
    a prefix of the draft's full chain there, then only -1; it stops some chains early, runs
    others past the never-skipped engine's K = 3, ends some steps' loops, and the text stays
    greedy's."""
    run = scenarios["stopped"]
    assert run["text"] == scenarios["plain"]
    chains, never = run["proposals"], scenarios["never_skipped"]["proposals"]
    kept = {key: _kept(p) for key, p in chains.items()}
    assert all(all(t < 0 for t in p[kept[key] :]) for key, p in chains.items())
    assert min(kept.values()) < 3 and max(kept.values()) > 3
    common = sorted(set(chains) & set(never))
    assert len(common) >= 20
    for key in common:
        m = min(kept[key], len(never[key]))
        assert chains[key][:m] == never[key][:m], key
    assert run["stopped_steps"] > 0
    # vLLM verified only what was proposed (a finished request's last proposal is not).
    spec = run["spec"]
    verified = spec["vllm:spec_decode_num_draft_tokens"]
    assert verified <= sum(kept.values()) < 8 * len(chains)
    assert "stop_below needs the cost-aware scheduler" in run["refused"]
    # The n-gram index the stop reads is each request's own text, all of it (and at most the
    # last step's few tokens past max_tokens).
    assert len(run["followed"]) == len(scenarios["plain"])
    assert all(same and full <= seen <= full + 8 for seen, same, full in run["followed"])


@pytest.mark.slow
def test_the_target_drafting_for_itself_at_t1_accepts_every_token(scenarios):
    counters = scenarios["self_draft_t1_probabilistic"]
    assert counters["vllm:spec_decode_num_draft_tokens"] > 100
    assert (
        counters["vllm:spec_decode_num_accepted_tokens"]
        == counters["vllm:spec_decode_num_draft_tokens"]
    )
    # Greedy drafting verifies the draft's argmax as a point mass: accepted with p(argmax).
    greedy = scenarios["self_draft_t1_greedy"]
    assert (
        greedy["vllm:spec_decode_num_accepted_tokens"] < greedy["vllm:spec_decode_num_draft_tokens"]
    )


def test_vllm_cpu_expand_kernel_is_broken_and_ours_is_right():
    """vLLM 0.32's CPU wrapper fills an int64 copy of the output and drops it: a request's
    temperature never reaches its draft tokens. Ours expands any dtype."""
    code = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()  # torch.ops._C, as a worker loads it
from vllm.utils import cpu_triton_utils as vllm_cpu
from pipeline.vllm_spec.cpu_kernels import expand_kernel_impl
temperature = torch.tensor([0.7, 0.0, 1.3])
cu = torch.tensor([2, 3, 6], dtype=torch.int32)
theirs = torch.full((6,), -5.0)
vllm_cpu._expand_kernel_impl(theirs, temperature, cu, 0, 1)
ours = torch.full((6,), -5.0)
expand_kernel_impl(ours, temperature, cu, 0, 1)
top_k = torch.full((6,), -1, dtype=torch.int32)
expand_kernel_impl(top_k, torch.tensor([5, 0, 9], dtype=torch.int32), cu, 0, 0)
print(theirs.tolist(), ours.tolist(), top_k.tolist())
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs, ours, top_k = json.loads("[" + done.stdout.strip().replace("] [", "], [") + "]")
    assert theirs == [-5.0] * 6  # untouched: the bug this plugin works around
    assert ours == pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3, 1.3])
    assert top_k == [5, 5, 0, 9, 9, 9]


@pytest.mark.slow
def test_an_engine_refuses_to_start_under_another_vllm_version():
    code = """
import vllm
vllm.__version__ = "0.31.0"
from vllm import LLM
try:
    LLM(model="models/target", dtype="float32", enforce_eager=True, max_model_len=256)
except Exception as exc:
    print("REFUSED", exc)
"""
    done = _run(code)
    assert "REFUSED" in done.stdout, done.stderr[-2000:]
    assert "written for vLLM 0.32.0" in done.stdout and "0.31.0" in done.stdout


def test_version_and_parts_are_checked():
    check_version("0.32.0")
    check_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match="written for vLLM 0.32.0"):
        check_version("0.33.1")
    assert parts({}) == ("kernels", "free_when_off")
    assert parts({"SPECBOUND_VLLM_PLUGIN": "kernels"}) == ("kernels",)
    assert parts({"SPECBOUND_VLLM_PLUGIN": ""}) == ()
    with pytest.raises(ValueError, match="unknown part"):
        parts({"SPECBOUND_VLLM_PLUGIN": "kernels,turbo"})


def test_stale_blocks_follow_skips_writes_cached_prefixes_and_resumes():
    from pipeline.vllm_spec.stale_blocks import StaleBlocks

    blocks = StaleBlocks(block_size=4)
    a = np.array([7, 3, 9, 5])
    assert blocks.first_stale("a", a, 0) is None  # a fresh prompt computes its own KV
    blocks.skipped(a, 0, 10)  # positions 0-9: blocks 7, 3, 9
    assert blocks.stale == {7, 3, 9}
    assert blocks.first_stale("a", a, 10) is None  # its own next step: not a cached prefix
    b = np.array([7, 3, 2, 6])
    assert blocks.first_stale("b", b, 8) == 0  # starts on cached blocks 7 and 3, both stale
    assert blocks.first_stale("b", b, 8) is None  # twice in a step: the same answer once
    blocks.written("b", b, 12)  # b caught up: 7, 3 and its own 2 hold draft KV now
    assert blocks.stale == {9}
    assert blocks.first_stale("a", a, 14) is None
    assert blocks.first_stale("a", a, 12) == 8  # a resumed after preemption: 7, 3 fresh, 9 not
    c = np.array([9, 1])
    assert blocks.first_stale("c", c, 4) == 0
    blocks.leave("c", 4)  # c drafts on over its stale prefix (an EAGLE head cannot catch up)
    blocks.written("c", c, 6)
    assert blocks.stale == {9}
    blocks.forget({"a"})
    assert set(blocks.last_start) == {"a"} and not blocks.left_stale
