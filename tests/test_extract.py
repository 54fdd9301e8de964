"""Extraction rows are what docs/contract.md says they are, checked against direct forwards."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from pipeline.data.references import ReferenceSequence, greedy_continuation
from pipeline.extract.junk_tails import ACCEPTANCES, TailSpecs, first_tokens, tail_specs
from pipeline.extract.keyed_random import (
    exclude_token,
    residual_probs,
    sample_from_probs,
    stable_key,
    uniforms,
)
from pipeline.extract.rows import extract_sequence
from pipeline.models.loading import ModelPair
from pipeline.models.routing import forward_with_routing
from tests.conftest import tiny_draft
from tests.tinymodels import VOCAB, cpu_pair, tiny_model

LMAX = 4
SETS = [("surrogate", 0), ("surrogate", 1), ("greedy", 0), ("sampling", 0), ("sampling", 1)]


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    return cpu_pair(tiny_model("qwen3_moe"), tiny_draft(VOCAB))


def _reference(n_prompt: int, n_response: int, seed: int = 11) -> ReferenceSequence:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n_prompt + n_response,), generator=gen).tolist()
    return ReferenceSequence("seq-a", "test", "given", tuple(ids[:n_prompt]), tuple(ids[n_prompt:]))


@pytest.fixture(scope="module")
def ref() -> ReferenceSequence:
    return _reference(6, 11)


@torch.no_grad()
def _direct_logits(pair: ModelPair, ref: ReferenceSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft and target logits after x_0 .. x_{N-1} (row s predicts x_{s+1}), plain forwards."""
    ids = torch.tensor([ref.all_ids])
    rows = slice(ref.prompt_len - 1, ref.prompt_len - 1 + ref.n_tokens)
    return pair.draft(ids).logits[0, rows].float(), pair.target(ids).logits[0, rows].float()


def _sets(tails) -> list[tuple[str, int]]:
    return sorted({(a, int(d)) for a, d in zip(tails["acceptance"], tails["draw"], strict=True)})


def test_tail_specs_cover_every_cell_of_every_set():
    n = 7
    shared = tail_specs(n, LMAX, "shared", 0, "x")
    assert list(dict.fromkeys(zip(shared.acceptance, shared.draw, strict=True))) == SETS
    for acc, d in SETS:
        one = shared.take(np.nonzero((shared.acceptance == acc) & (shared.draw == d))[0])
        assert one.s.tolist() == list(range(n))
        assert one.length.tolist() == [min(LMAX, n - s) for s in range(n)]
    assert len(set(shared.key.tolist())) == len(shared)  # every tail, set and draw its own key
    paper = tail_specs(n, LMAX, "paper", 0, "x", acceptances=("sampling",), draws=1)
    cells = {(i, k, a) for i, k, a in zip(paper.i, paper.k, paper.a, strict=True)}
    expected = {
        (i, k, a) for i in range(n) for k in range(1, min(LMAX, n - i) + 1) for a in range(k)
    }
    assert cells == expected and len(paper) == len(expected)
    assert np.array_equal(paper.s, paper.i + paper.a)
    assert np.array_equal(paper.length, paper.k - paper.a)
    greedy = tail_specs(n, LMAX, "paper", 0, "x", acceptances=("greedy",), draws=3)
    assert set(greedy.draw.tolist()) == {0} and len(greedy) == len(expected)
    with pytest.raises(ValueError, match="tail mode 'full'"):
        tail_specs(n, LMAX, "full", 0, "x")
    for bad in [("exact",), (), ("greedy", "greedy")]:
        with pytest.raises(ValueError, match="acceptances"):
            tail_specs(n, LMAX, "shared", 0, "x", acceptances=bad)
    with pytest.raises(ValueError, match="draws"):
        tail_specs(n, LMAX, "shared", 0, "x", draws=0)


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


def test_first_tokens_follow_each_rule_exactly():
    """Empirical first-token frequencies over 40,000 keys against the exact distribution of each
    rule (6 tokens): the standard error per token is <= 0.0025, so the 0.01 tolerance (4 sigma)
    catches any per-token bias of about 0.01 or more."""
    temperature, draws = 0.7, 40_000
    gen = torch.Generator().manual_seed(3)
    q_logits, p_logits = torch.randn(2, 1, 6, generator=gen)
    forbidden = int(q_logits.argmax())
    q = torch.softmax(q_logits[0] / temperature, -1).double()
    pi = torch.softmax(p_logits[0] / temperature, -1).double()
    surrogate = q.clone()
    surrogate[forbidden] = 0.0
    expected = {
        "surrogate": surrogate / surrogate.sum(),
        "sampling": (q - pi).clamp(min=0) / (q - pi).clamp(min=0).sum(),
    }
    for acc, exact in expected.items():
        specs = tail_specs(draws, 1, "shared", 0, "row", acceptances=(acc,), draws=1)
        drawn = first_tokens(
            q_logits.expand(draws, -1),
            p_logits.expand(draws, -1),
            torch.full((draws,), forbidden),
            specs,
            temperature,
        )
        freq = np.bincount(drawn, minlength=6) / draws
        np.testing.assert_allclose(freq, exact.numpy(), atol=0.01, err_msg=acc)
        assert (freq[exact.numpy() == 0] == 0).all(), acc  # never off the rule's support
    greedy = tail_specs(3, 1, "shared", 0, "row", acceptances=("greedy",))
    three = first_tokens(
        q_logits.expand(3, -1),
        p_logits.expand(3, -1),
        torch.full((3,), forbidden),
        greedy,
        temperature,
    )
    assert three.tolist() == [forbidden] * 3  # the argmax, even where it is the reference token
    # Draft = target: the residual has no mass, so the surrogate's rule (never x_{s+1}) applies.
    assert residual_probs(q.view(1, -1), q.view(1, -1)).sum() == 0
    specs = tail_specs(500, 1, "shared", 0, "row", acceptances=("sampling",), draws=1)
    same = first_tokens(
        q_logits.expand(500, -1),
        q_logits.expand(500, -1),
        torch.full((500,), forbidden),
        specs,
        temperature,
    )
    assert forbidden not in same.tolist() and len(set(same.tolist())) > 1


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
    draft_logits, target_logits = _direct_logits(pair, ref)
    assert tokens["draft_prob"][0] is None and tokens["draft_match"][0] is None
    assert tokens["target_prob"][0] is None
    for t in range(1, n + 1):
        x = ref.all_ids[ref.prompt_len - 1 + t]
        row, target_row = draft_logits[t - 1], target_logits[t - 1]
        expected = torch.softmax(row, -1)[x].item()
        assert tokens["draft_prob"][t] == pytest.approx(expected, rel=1e-4, abs=1e-7)
        assert tokens["draft_match"][t] == (int(row.argmax()) == x)
        expected = torch.softmax(target_row, -1)[x].item()
        assert tokens["target_prob"][t] == pytest.approx(expected, rel=1e-4, abs=1e-7)

    tails = out.tails.to_pandas()
    assert _sets(tails) == sorted(SETS)
    key = ["acceptance", "draw", "s"] if mode == "shared" else ["acceptance", "draw", "i", "k", "a"]
    for (acc, *_), tail in tails.groupby(key, sort=False):
        s = int(tail["s"].iloc[0])
        assert tail["r"].tolist() == list(range(1, len(tail) + 1))
        if acc == "surrogate":  # its first junk token is never the reference token it replaces
            assert int(tail["token_id"].iloc[0]) != ref.all_ids[ref.prompt_len + s]
        chain = list(ref.all_ids[: ref.prompt_len + s]) + tail["token_id"].tolist()
        _, plain = forward_with_routing(pair.target, pair.spec, torch.tensor([chain]))
        packed = np.stack([np.array(e.tolist()) for e in tail["experts"]])
        assert np.array_equal(plain[0, -len(tail) :].numpy(), packed), (mode, acc, s)
    if mode == "shared":
        for _, one in tails.groupby(["acceptance", "draw"]):
            assert one.groupby("s").size().tolist() == [min(LMAX, n - s) for s in range(n)]
    assert out.stats.tail_tokens == len(tails)
    assert out.stats.tails == len(tails.groupby(key))


def test_probabilities_follow_the_temperature(pair, ref):
    temperature = 0.5
    out = extract_sequence(
        pair, ref, 1, "shared", 0, acceptances=("greedy",), temperature=temperature
    )
    tokens = out.tokens.to_pydict()
    draft_logits, target_logits = _direct_logits(pair, ref)
    x = torch.tensor(ref.response_ids).view(-1, 1)
    for name, logits in (("draft_prob", draft_logits), ("target_prob", target_logits)):
        expected = torch.softmax(logits / temperature, -1).gather(1, x).view(-1).tolist()
        assert tokens[name][1:] == pytest.approx(expected, rel=1e-4, abs=1e-7), name
    with pytest.raises(ValueError, match="temperature"):
        extract_sequence(pair, ref, 1, "shared", 0, temperature=0.0)


def test_greedy_tails_are_the_drafts_greedy_continuation(pair):
    ref = _reference(5, 24, seed=4)
    tails = {}
    for temperature in (1.0, 0.3):  # greedy tails do not depend on the temperature
        out = extract_sequence(
            pair, ref, LMAX, "shared", 0, acceptances=("greedy",), temperature=temperature
        )
        tails[temperature] = out.tails
    assert tails[1.0].equals(tails[0.3])
    rows = tails[1.0].to_pandas()
    assert set(rows["draw"]) == {0}
    for s, tail in rows.groupby("s"):
        prefix = list(ref.all_ids[: ref.prompt_len + int(s)])
        expected = greedy_continuation(pair.draft, prefix, len(tail), eos_id=None)
        assert tail["token_id"].tolist() == expected, s


def test_sampling_tails_start_only_where_the_draft_outweighs_the_target(pair):
    """y_1 ~ norm(max(q - pi, 0)): over 40 divergence points and 3 draws, each first token has
    q > pi at temperature 0.8 (a rule that drew from q instead would break this ~40% of times)."""
    temperature = 0.8
    ref = _reference(5, 40, seed=7)
    out = extract_sequence(
        pair, ref, 2, "shared", 1, acceptances=("sampling",), draws=3, temperature=temperature
    )
    first = out.tails.filter(pc.equal(out.tails.column("r"), 1)).to_pydict()
    assert len(first["s"]) == 3 * ref.n_tokens
    draft_logits, target_logits = _direct_logits(pair, ref)
    q = torch.softmax(draft_logits / temperature, -1)
    pi = torch.softmax(target_logits / temperature, -1)
    s, y = torch.tensor(first["s"]), torch.tensor(first["token_id"])
    assert (q[s, y] > pi[s, y]).all()
    assert len(set(zip(first["s"], first["token_id"], strict=True))) > ref.n_tokens  # draws vary


def test_draws_differ_and_each_is_deterministic(pair, ref):
    a = extract_sequence(pair, ref, LMAX, "shared", seed=5)
    b = extract_sequence(pair, ref, LMAX, "shared", seed=5)
    assert a.tails.equals(b.tails) and a.tokens.equals(b.tokens)
    rows = a.tails.to_pandas()
    for acc in ("surrogate", "sampling"):
        d0, d1 = (rows[(rows.acceptance == acc) & (rows.draw == d)] for d in (0, 1))
        assert d0[["s", "r"]].values.tolist() == d1[["s", "r"]].values.tolist()
        assert (d0["token_id"].values != d1["token_id"].values).mean() > 0.3, acc


def test_extraction_is_deterministic_and_independent_of_packing(pair, ref):
    a = extract_sequence(pair, ref, LMAX, "paper", seed=5, chunk_tokens=4096)
    b = extract_sequence(pair, ref, LMAX, "paper", seed=5, chunk_tokens=7)
    assert a.tokens.equals(b.tokens)
    assert a.tails.equals(b.tails)
    c = extract_sequence(pair, ref, LMAX, "paper", seed=6)
    assert not a.tails.column("token_id").equals(c.tails.column("token_id"))
    # A set extracted alone equals the same set packed with every other one.
    alone = extract_sequence(
        pair, ref, LMAX, "paper", seed=5, acceptances=("sampling",), chunk_tokens=11
    )
    assert alone.tails.equals(a.tails.filter(pc.equal(a.tails.column("acceptance"), "sampling")))


@pytest.mark.parametrize("mode", ["shared", "paper"])
def test_union_table_for_a_smaller_lmax_reads_only_its_cells(pair, ref, mode):
    from pipeline.oracle.union_from_tables import sequence_union_table

    out = extract_sequence(pair, ref, LMAX, mode, seed=3, acceptances=("surrogate",), draws=1)
    full = sequence_union_table(out.tokens, out.tails, pair.spec, LMAX)
    small = sequence_union_table(out.tokens, out.tails, pair.spec, 2)
    assert small.shape == (ref.n_tokens, 3, 3)  # [i, k, a], k = 0..lmax
    np.testing.assert_array_equal(small, full[:, :3, :3])


def test_tail_specs_take_keeps_every_field():
    specs = tail_specs(5, 2, "shared", 0, "x")
    picked = specs.take(np.array([0, len(specs) - 1]))
    assert isinstance(picked, TailSpecs) and len(picked) == 2
    assert picked.acceptance.tolist() == [ACCEPTANCES[0], ACCEPTANCES[-1]]
    assert picked.draw.tolist() == [0, 1]
