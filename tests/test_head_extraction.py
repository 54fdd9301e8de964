"""Extraction with an EAGLE-3 head as the draft, checked against the engine's own head drafter:
the tokens table's draft probability is the distribution the head drafts the first token of a
chain from after each prefix, a greedy junk tail is the chain the engine drafts there at T = 0,
every tail's routing is the target's plain forward over prefix + tail, sampled tails are keyed
(deterministic, independent of packing), and the extraction feeds the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.references import ReferenceSequence
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.rows import extract_sequence, extract_sequences
from pipeline.models.loading import ModelPair
from pipeline.models.routing import forward_with_routing
from tests.tinymodels import VOCAB, cpu_pair, tiny_head, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LMAX = 4


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    target = tiny_model("qwen3_moe", seed=21)
    return cpu_pair(target, tiny_head(target, seed=22, draft_vocab=200))


def _reference(n_prompt: int, n_response: int, seed: int = 5) -> ReferenceSequence:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n_prompt + n_response,), generator=gen).tolist()
    return ReferenceSequence("seq-h", "test", "given", tuple(ids[:n_prompt]), tuple(ids[n_prompt:]))


@pytest.fixture(scope="module")
def ref() -> ReferenceSequence:
    return _reference(5, 12)


@torch.no_grad()
def _engine_first_token(pair: ModelPair, prefix: list[int], temperature: float) -> torch.Tensor:
    """The distribution the engine's head drafter drafts the next token from after ``prefix``."""
    policy = make_policy("fixed", k=1)
    session = SpeculativeEngine(pair).start(prefix, policy, SamplingConfig(temperature), seed=0)
    drafter = session.drafter
    drafter.start_step()
    try:
        return drafter.begin(session.committed).clone()
    finally:
        drafter.end()


def test_draft_probabilities_are_the_heads_first_draft(pair, ref):
    temperature = 0.7
    out = extract_sequence(
        pair, ref, LMAX, "shared", 0, acceptances=("greedy",), temperature=temperature
    )
    tokens = out.tokens.to_pydict()
    assert tokens["draft_prob"][0] is None
    for t in range(1, ref.n_tokens + 1):
        prefix = list(ref.all_ids[: ref.prompt_len + t - 1])  # .. x_{t-1}
        x = ref.all_ids[ref.prompt_len + t - 1]
        probs = _engine_first_token(pair, prefix, temperature)
        assert tokens["draft_prob"][t] == pytest.approx(probs[x].item(), rel=1e-4, abs=1e-7), t
        assert tokens["draft_match"][t] == (int(probs.argmax()) == x)


def test_greedy_tails_are_the_chains_the_engine_drafts(pair):
    ref = _reference(4, 16, seed=8)
    out = extract_sequence(pair, ref, LMAX, "shared", 0, acceptances=("greedy",))
    rows = out.tails.to_pandas()
    assert rows.groupby("s").size().tolist() == [min(LMAX, ref.n_tokens - s) for s in range(16)]
    engine = SpeculativeEngine(pair)
    for s, tail in rows.groupby("s"):
        prefix = list(ref.all_ids[: ref.prompt_len + int(s)])  # .. x_s
        session = engine.start(prefix, make_policy("fixed", k=len(tail)))
        cands, _ = session.draft()
        assert tail["token_id"].tolist() == cands.tokens, s


def test_tails_are_routed_as_plain_forwards_and_keyed(pair, ref):
    a = extract_sequence(pair, ref, LMAX, "shared", seed=3, chunk_tokens=4096)
    b = extract_sequence(pair, ref, LMAX, "shared", seed=3, chunk_tokens=5)
    assert a.tails.equals(b.tails) and a.tokens.equals(b.tokens)
    tails = a.tails.to_pandas()
    assert set(tails["acceptance"]) == {"surrogate", "greedy", "sampling"}
    for (acc, draw, s), tail in tails.groupby(["acceptance", "draw", "s"]):
        if acc == "surrogate":  # never the reference token it replaces
            assert int(tail["token_id"].iloc[0]) != ref.all_ids[ref.prompt_len + s]
        chain = list(ref.all_ids[: ref.prompt_len + s]) + tail["token_id"].tolist()
        _, plain = forward_with_routing(pair.target, pair.spec, torch.tensor([chain]))
        packed = np.stack([np.array(e.tolist()) for e in tail["experts"]])
        assert np.array_equal(plain[0, -len(tail) :].numpy(), packed), (acc, draw, s)
    # Tokens outside the reduced draft vocabulary are never drafted.
    d2t = pair.draft.d2t + torch.arange(pair.draft.cfg.draft_vocab_size)
    assert set(tails["token_id"]) <= set(d2t.tolist())


def test_a_batch_of_sequences_equals_each_alone(pair, ref):
    other = _reference(7, 9, seed=9)
    together = extract_sequences(pair, [ref, other], LMAX, "shared", 1, batch_size=2)
    for tables, one in zip(together, (ref, other), strict=True):
        alone = extract_sequence(pair, one, LMAX, "shared", 1)
        assert tables.tokens.equals(alone.tokens) and tables.tails.equals(alone.tails)


def test_draft_trees_with_a_head_are_refused_by_name(pair, ref):
    with pytest.raises(ValueError, match="draft-tree extraction.*EAGLE-3 head"):
        extract_sequence(pair, ref, LMAX, "shared", 0, trees=(TreeRule("eagle2"),))
