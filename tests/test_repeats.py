"""The repeat signal (pipeline.acceptance.repeats): what happened after the context's last
occurrence, the same definition on traces and online, its two weights fitted on the `next`
logit, read by the model only when fitted and only at T = 0, and recorded by `throughput` from
the outcomes it sees (verification and the catch-up forward) with the draft's own argmax."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pipeline.acceptance.features import FEATURE_NAMES, MAX_MATCH, logistic
from pipeline.acceptance.model import AcceptanceModel, ModeModel
from pipeline.acceptance.repeats import (
    RepeatMemory,
    chain_repeat_indicators,
    fit_repeat_weights,
    indicators,
    repeat_indicators,
)
from pipeline.acceptance.traces import AcceptanceTrace
from pipeline.acceptance.training import fit_acceptance
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.throughput import ThroughputPolicy
from pipeline.decode.types import SamplingConfig
from pipeline.models.draft_pass import draft_pass
from pipeline.models.loading import REPO_ROOT, load_pair

W = len(FEATURE_NAMES)
HEAD = REPO_ROOT / "models" / "eagle3-head"


def test_indicators_read_the_outcome_after_the_longest_earlier_occurrence():
    tokens = [5, 1, 2, 1, 2, 1, 2]
    labels = [1, 1, 1, 0, 1, 1, 1]
    marks = repeat_indicators(tokens, labels)
    # i = 4 ends (1, 2), last seen ending at 2: position 3 was missed. i = 5 ends (1, 2, 1),
    # last seen ending at 3: position 4 agreed. i = 6 ends (2, 1, 2, ...): the longest earlier
    # suffix is (1, 2, 1, 2) ending at 4, followed by position 5 (agreed).
    assert marks.tolist() == [[0, 0], [0, 0], [0, 0], [0, 0], [0, 1], [1, 0], [1, 0]]


def _brute(tokens, known, tail):
    """The outcome after the latest earlier occurrence (any, with a known follower) of the
    longest suffix of ``tail`` in ``tokens``."""
    for n in range(min(8, len(tail)), 1, -1):
        ends = [e for e in range(n - 1, len(tokens)) if tokens[e - n + 1 : e + 1] == tail[-n:]]
        ends = [e for e in ends if e + 1 < len(known)]
        if ends:
            return known[max(ends) + 1]
    return None


def test_text_and_chain_indicators_equal_a_brute_force_search():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(5, 40))
        tokens = rng.integers(0, 3, n).tolist()
        first = (rng.uniform(size=n) < 0.7).astype(float)
        text = repeat_indicators(tokens, first)
        for i in range(n):
            want = _brute(tokens[:i], [bool(b) for b in first[:i]], tokens[: i + 1])
            assert text[i].tolist() == list(indicators(want)), (tokens, i)
        # A head's chains (depth <= 3 from every position): the chain's tokens not committed.
        depth = np.concatenate([np.arange(1, min(3, n - c) + 1) for c in range(n)])
        labels = np.zeros(len(depth))
        labels[depth == 1] = first
        chains = chain_repeat_indicators(tokens, labels, depth)
        starts = np.cumsum(depth == 1) - 1
        for r, (c, d) in enumerate(zip(starts, depth, strict=True)):
            want = _brute(tokens[:c], [bool(b) for b in first[:c]], tokens[: c + d])
            assert chains[r].tolist() == list(indicators(want)), (tokens, c, d)


def test_the_memory_skips_an_occurrence_whose_follower_is_not_known_yet():
    memory = RepeatMemory()
    memory.extend([7, 8, 7, 8])
    for position, agreed in ((1, True), (2, False), (3, True)):
        memory.observe(position, agreed)
    # (7, 8) last ends at 3 (the last committed token: its follower is the next token, not
    # judged yet), before that at 1, followed by a miss.
    assert memory.outcome([7, 8]) is False
    assert memory.outcome([9, 9]) is None  # never here
    assert memory.outcome([8]) is None  # one token is not a repeat
    assert memory.match([7], 8) == 2  # the context match still reads the same index


def test_fitted_weights_recover_the_labels_log_odds():
    rng = np.random.default_rng(0)
    n = 20000
    marks = np.zeros((n, 2))
    kind = rng.integers(0, 3, n)
    marks[kind == 1, 0] = 1
    marks[kind == 2, 1] = 1
    z = rng.normal(size=n)
    y = rng.uniform(size=n) < 1 / (1 + np.exp(-(z + 2.0 * marks[:, 0] - 1.5 * marks[:, 1])))
    weights = fit_repeat_weights(z, marks, y.astype(float), np.ones(n), l2=1e-6)
    assert weights == pytest.approx([2.0, -1.5], abs=0.15)


def _mode(repeat: list[float]) -> ModeModel:
    weights = [0.5] + [0.0] * (W - 1)
    return ModeModel(weights, weights, 0.6, [], [0.5], repeat)


def test_the_next_model_reads_the_repeat_only_when_fitted():
    stats = [0.0] * (W - 2)
    plain = _mode([]).chain_view(stats, 0.5, None, 2, 0.8, 0.0, True)
    fitted = _mode([1.5, -2.0])
    assert fitted.chain_view(stats, 0.5, None, 2, 0.8) == plain  # not asked: unchanged
    a_now, later = fitted.chain_view(stats, 0.5, None, 2, 0.8, 0.0, True)
    assert a_now == plain[0]  # the token about to be drafted does not read it
    assert later == pytest.approx([logistic(0.5 + 1.5)] * 2)
    _, later = fitted.chain_view(stats, 0.5, None, 2, 0.8, 0.0, False)
    assert later == pytest.approx([logistic(0.5 - 2.0)] * 2)
    with pytest.raises(ValueError, match="repeat: expected 2 weights"):
        _mode([1.0])


def test_the_outcome_lookup_from_the_context_match_is_the_full_ones():
    """Given the tail's context match (no longer suffix occurs), the lookup starts there and
    finds what the search from MAX_MATCH finds."""
    rng = np.random.default_rng(3)
    memory = RepeatMemory()
    text = [int(t) for t in rng.integers(0, 5, size=300)]
    for i, tok in enumerate(text):
        memory.extend([tok])
        memory.observe(i, bool(rng.integers(0, 2)))
    for _ in range(300):
        tail = [int(t) for t in rng.integers(0, 5, size=MAX_MATCH)]
        longest = memory.match(tail[:-1], tail[-1])
        assert memory.outcome(tail, longest) == memory.outcome(tail)


def test_saved_repeat_weights_round_trip_and_older_files_load_without(tmp_path):
    model = AcceptanceModel({"greedy": _mode([1.0, -1.0])}, [4.0], 0.8)
    model.save(tmp_path / "a.json")
    assert AcceptanceModel.load(tmp_path / "a.json").modes["greedy"].repeat == [1.0, -1.0]
    old = model.to_json()
    del old["modes"]["greedy"]["repeat"]
    (tmp_path / "old.json").write_text(__import__("json").dumps(old))
    assert AcceptanceModel.load(tmp_path / "old.json").modes["greedy"].repeat == []


def test_fit_learns_repeat_weights_and_none_without_the_texts():
    rng = np.random.default_rng(2)
    traces = []
    for i in range(10):
        # A loop the draft follows except at one place in it, every time round.
        tokens = np.array([1, 2, 3, 4] * 30)
        labels = np.where(tokens == 3, 0.0, 1.0)
        labels[rng.uniform(size=len(tokens)) < 0.05] = 0.0
        stats = rng.uniform(size=(len(tokens), W - 2))
        hidden = rng.normal(size=(120, 2))
        traces.append(AcceptanceTrace(f"p{i}", 0.0, stats, labels, hidden, tokens=tokens))
    model, report = fit_acceptance(traces, [4.0], heldout_every=5)
    repeat = model.modes["greedy"].repeat
    assert repeat[0] > 0 > repeat[1]
    r = report["greedy"]["repeat"]
    assert r["heldout_log_loss_with"] < r["heldout_log_loss_without"]
    older = [replace(t, tokens=None) for t in traces]  # traces saved before texts were kept
    model, report = fit_acceptance(older, [4.0], heldout_every=5)
    assert model.modes["greedy"].repeat == [] and report["greedy"]["repeat"]["fitted"] is False


def test_every_committed_pair_reads_repeats_at_t0_only(embedded_artifacts):
    two = AcceptanceModel.load(REPO_ROOT / "models" / "draft-2layer" / "acceptance.json")
    head = AcceptanceModel.load(HEAD / "acceptance.json")  # fitted along its chains
    for model in (embedded_artifacts.acceptance, two, head):
        agreed, missed = model.mode(True).repeat
        assert agreed > 0 > missed  # agreeing there before is a good sign, missing a bad one
        assert not model.mode(False).repeat  # T > 0: no argmax outcome


@pytest.mark.parametrize("draft", ["model", "head"])
def test_recorded_outcomes_are_the_drafts_teacher_forced_argmax(
    draft, embedded_pair, fib_ids, embedded_artifacts
):
    """What `throughput` records at T = 0 (verification and the catch-up forward, whose rows a
    head shifts by one: Drafter.ROW_AHEAD) is, position by position, whether the draft's
    teacher-forced argmax is the committed token; the prompt's positions are not outcomes."""
    pair = embedded_pair if draft == "model" else load_pair(draft=HEAD, device="cpu")
    policy = ThroughputPolicy(embedded_artifacts.cost, embedded_artifacts.acceptance, max_k=4)
    session = SpeculativeEngine(pair).start(fib_ids, policy, SamplingConfig(0.0), seed=0)
    policy.outcomes.memory = policy._index  # recorded whether or not the model reads it
    while len(session.generated) < 32:
        session.step()
    text = session.committed
    argmax = draft_pass(pair, torch.tensor([text]))[0][0].argmax(-1).tolist()
    agreed = policy.outcomes.memory.agreed
    assert len(agreed) >= 24  # nearly every generated position but the last step's
    for position, hit in agreed.items():
        assert len(fib_ids) <= position < len(text)
        assert hit == (argmax[position - 1] == text[position]), position


def test_no_outcome_is_recorded_when_sampling(embedded_pair, fib_ids, embedded_artifacts):
    policy = ThroughputPolicy(embedded_artifacts.cost, embedded_artifacts.acceptance, max_k=4)
    session = SpeculativeEngine(embedded_pair).start(fib_ids, policy, SamplingConfig(1.0), seed=0)
    for _ in range(4):
        session.step()
    assert policy.outcomes.memory is None
