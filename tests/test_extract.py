"""Extraction rows are what DESIGN section 3 says they are, checked against direct forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.references import ReferenceSequence
from pipeline.extract.junk_tails import tail_specs
from pipeline.extract.keyed_random import exclude_token, sample_from_probs, stable_key, uniforms
from pipeline.extract.rows import extract_sequence
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import ModelPair
from pipeline.models.routing import forward_with_routing
from tests.conftest import tiny_draft
from tests.tinymodels import VOCAB, tiny_model

LMAX = 4


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    target = tiny_model("qwen3_moe")
    return ModelPair(
        target=target,
        draft=tiny_draft(VOCAB),
        tokenizer=None,
        spec=moe_spec(target.config),
        device=torch.device("cpu"),
        dtype=torch.float32,
        experts_implementation="eager",
        target_path="tiny",
        draft_path="tiny",
    )


@pytest.fixture(scope="module")
def ref() -> ReferenceSequence:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, VOCAB, (17,), generator=gen).tolist()
    return ReferenceSequence("seq-a", "test", "given", tuple(ids[:6]), tuple(ids[6:]))


def test_tail_specs_cover_every_cell():
    n = 7
    shared = tail_specs(n, LMAX, "shared", 0, "x")
    assert shared.s.tolist() == list(range(n))
    assert shared.length.tolist() == [min(LMAX, n - s) for s in range(n)]
    paper = tail_specs(n, LMAX, "paper", 0, "x")
    cells = {(i, k, a) for i, k, a in zip(paper.i, paper.k, paper.a, strict=True)}
    expected = {
        (i, k, a) for i in range(n) for k in range(1, min(LMAX, n - i) + 1) for a in range(k)
    }
    assert cells == expected and len(paper) == len(expected)
    assert np.array_equal(paper.s, paper.i + paper.a)
    assert np.array_equal(paper.length, paper.k - paper.a)
    with pytest.raises(ValueError, match="tail mode 'full'"):
        tail_specs(n, LMAX, "full", 0, "x")


def test_sampling_is_keyed_not_batched():
    keys = np.array([stable_key(0, "s", j) for j in range(50)], dtype=np.uint64)
    assert np.array_equal(uniforms(keys, 3)[10:20], uniforms(keys[10:20], 3))
    assert not np.array_equal(uniforms(keys, 3), uniforms(keys, 4))
    u = uniforms(keys, 1)
    assert ((u >= 0) & (u < 1)).all()
    probs = torch.softmax(torch.randn(50, 9, generator=torch.Generator().manual_seed(0)), -1)
    forbidden = probs.argmax(-1)
    probs[0] = 0.0
    probs[0, forbidden[0]] = 1.0  # certain of the forbidden token: falls back to uniform
    drawn = sample_from_probs(exclude_token(probs, forbidden), u)
    assert (drawn != forbidden).all()


@pytest.mark.parametrize("mode", ["shared", "paper"])
def test_extracted_rows_match_direct_forwards(pair, ref, mode):
    out = extract_sequence(pair, ref, LMAX, mode, seed=3)
    tokens = out.tokens.to_pydict()
    n = ref.n_tokens
    assert tokens["t"] == list(range(n + 1))
    assert tokens["token_id"] == list(ref.all_ids[ref.prompt_len - 1 :])
    ids = torch.tensor([ref.all_ids])
    _, routing = forward_with_routing(pair.target, pair.spec, ids)
    assert np.array_equal(np.array(tokens["experts"]), routing[0, ref.prompt_len - 1 :].numpy())
    with torch.no_grad():
        logits = pair.draft(ids).logits[0].float()
    assert tokens["draft_prob"][0] is None and tokens["draft_match"][0] is None
    for t in range(1, n + 1):
        row = logits[ref.prompt_len - 2 + t]
        expected = torch.softmax(row, -1)[ref.all_ids[ref.prompt_len - 1 + t]].item()
        assert tokens["draft_prob"][t] == pytest.approx(expected, rel=1e-4, abs=1e-7)
        assert tokens["draft_match"][t] == (
            int(row.argmax()) == ref.all_ids[ref.prompt_len - 1 + t]
        )

    tails = out.tails.to_pandas()
    key = ["s"] if mode == "shared" else ["i", "k", "a"]
    for _, tail in tails.groupby(key, sort=False):
        s = int(tail["s"].iloc[0])
        assert tail["r"].tolist() == list(range(1, len(tail) + 1))
        # The first junk token is never the reference token it replaces.
        assert int(tail["token_id"].iloc[0]) != ref.all_ids[ref.prompt_len + s]
        chain = list(ref.all_ids[: ref.prompt_len + s]) + tail["token_id"].tolist()
        _, plain = forward_with_routing(pair.target, pair.spec, torch.tensor([chain]))
        packed = np.stack([np.array(e.tolist()) for e in tail["experts"]])
        assert np.array_equal(plain[0, -len(tail) :].numpy(), packed), (mode, s)
    if mode == "shared":
        assert tails.groupby("s").size().tolist() == [min(LMAX, n - s) for s in range(n)]
    assert out.stats.tail_tokens == len(tails)


def test_extraction_is_deterministic_and_independent_of_packing(pair, ref):
    a = extract_sequence(pair, ref, LMAX, "paper", seed=5, chunk_tokens=4096)
    b = extract_sequence(pair, ref, LMAX, "paper", seed=5, chunk_tokens=7)
    assert a.tokens.equals(b.tokens)
    assert a.tails.column("token_id").equals(b.tails.column("token_id"))
    assert a.tails.column("experts").equals(b.tails.column("experts"))
    c = extract_sequence(pair, ref, LMAX, "paper", seed=6)
    assert not a.tails.column("token_id").equals(c.tails.column("token_id"))


@pytest.mark.parametrize("mode", ["shared", "paper"])
def test_union_table_for_a_smaller_lmax_reads_only_its_cells(pair, ref, mode):
    from pipeline.oracle.union_from_tables import sequence_union_table

    out = extract_sequence(pair, ref, LMAX, mode, seed=3)
    full = sequence_union_table(out.tokens, out.tails, pair.spec, LMAX)
    small = sequence_union_table(out.tokens, out.tails, pair.spec, 2)
    assert small.shape == (ref.n_tokens, 2, 3)
    np.testing.assert_array_equal(small, full[:, :2, :3])
