"""Batched extraction gives the rows of the one-sequence-at-a-time path.

Greedy references are decoded many prompts at a time (left padding, a 2D mask, per-row
positions, one cache) and the teacher-forced passes run several sequences per forward. Float
rounding differs in a padded batch, so a greedy argmax, a sampled token or a router's top-k may
flip where the one-at-a-time path sits on a near-tie; every difference below must be shown to be
one (on the lone path: the other choice within ``TIE`` of the chosen one), and is reported as a
warning, never skipped silently.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.data.prompts import Prompt
from pipeline.data.references import (
    ReferenceSequence,
    build_references,
    greedy_continuation,
    greedy_continuations,
)
from pipeline.extract.junk_tails import tail_specs
from pipeline.extract.keyed_random import exclude_token, residual_probs, uniforms
from pipeline.extract.rows import SequenceTables, extract_sequences
from pipeline.extract.teacher_forced import teacher_forced, teacher_forced_batch
from pipeline.models.loading import ModelPair
from tests.conftest import tiny_draft
from tests.tinymodels import FAMILIES, VOCAB, cpu_pair, tiny_model

TIE = 1e-3  # a near-tie: the other choice within TIE (relative to max(1, |top|)) on the lone path
LMAX, BUDGET, TEMPERATURE = 4, 20, 0.8
PROMPT_LENS = (3, 11, 6, 1, 15, 8)
RESPONSE_LENS = (9, 4, 14, 7, 1, 12)


def _pair(target) -> ModelPair:
    return cpu_pair(target, tiny_draft(VOCAB))


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    return _pair(tiny_model("qwen3_moe"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _refs() -> list[ReferenceSequence]:
    return [
        ReferenceSequence(f"r{j}", "test", "given", tuple(_ids(p, j)), tuple(_ids(n, 100 + j)))
        for j, (p, n) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True))
    ]


def _near(top: float, other: float) -> bool:
    return top - other < TIE * max(1.0, abs(top))


def _note(what: str) -> None:
    warnings.warn(f"near-tie, batched row differs: {what}", stacklevel=2)


@torch.no_grad()
def _last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


@torch.no_grad()
def _assert_greedy_same_or_tie(model, prompt: list[int], lone: list[int], batched: list[int]):
    if lone == batched:
        return
    d = next(i for i, (a, b) in enumerate(zip(lone, batched, strict=False)) if a != b)
    logits = _last_logits(model, prompt + lone[:d])
    top, other = logits[lone[d]].item(), logits[batched[d]].item()
    assert int(logits.argmax()) == lone[d]
    assert _near(top, other), f"token {d}: logits {top:.6f} vs {other:.6f} is no near-tie"
    _note(f"greedy token {d} of a {len(prompt)}-token prompt, logit gap {top - other:.2e}")


# --- greedy references -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "draft"])
def test_batched_greedy_continuations_equal_unbatched(family):
    model = tiny_draft(VOCAB) if family == "draft" else tiny_model(family)
    prompts = [_ids(n, 7 + n) for n in PROMPT_LENS]
    free = greedy_continuations(model, prompts, BUDGET, None, batch_size=1)
    # EOS: a token row 0 first emits mid-way, so that row stops early while others go on.
    stop = next(i for i in range(3, BUDGET) if free[0][i] not in free[0][:i])
    eos = free[0][stop]
    lone = greedy_continuations(model, prompts, BUDGET, eos, batch_size=1)
    assert lone == [greedy_continuation(model, p, BUDGET, eos) for p in prompts]  # today's path
    assert len(lone[0]) == stop + 1 and lone[0][-1] == eos
    for batch_size in (2, 4, 16):
        batched = greedy_continuations(model, prompts, BUDGET, eos, batch_size=batch_size)
        for prompt, a, b in zip(prompts, lone, batched, strict=True):
            assert len(b) <= BUDGET and (b[-1] == eos or len(b) == BUDGET)
            assert eos not in b[:-1]  # a finished row's later tokens are dropped
            _assert_greedy_same_or_tie(model, prompt, a, b)
    with pytest.raises(ValueError, match="batch_size"):
        greedy_continuations(model, prompts, BUDGET, eos, batch_size=0)


class _Tokenizer:
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % (VOCAB - 1) for c in text]}


def test_build_references_batches_only_the_greedy_ones(pair):
    texts = ["def f(x):", "a", "print(1 + 2)", "import os", "x = [1, 2]"]
    prompts = [
        Prompt(f"p{j}", t, t, "test", reference="ab" if j == 2 else None)
        for j, t in enumerate(texts)
    ]
    args = (prompts, pair.target, _Tokenizer(), 10, True)
    lone = build_references(*args, batch_size=1)
    batched = build_references(*args, batch_size=3)
    assert [r.source for r in batched] == ["greedy", "greedy", "given", "greedy", "greedy"]
    for a, b in zip(lone, batched, strict=True):
        assert (a.seq_id, a.source, a.prompt_ids) == (b.seq_id, b.source, b.prompt_ids)
        _assert_greedy_same_or_tie(
            pair.target, list(a.prompt_ids), list(a.response_ids), list(b.response_ids)
        )


# --- teacher-forced passes ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_teacher_forced_passes_equal_lone_ones(family):
    """Logits and each row's cache (full, sliding-window, MLA layers) as a lone pass gives."""
    extra = {"max_position_embeddings": 512}
    pair = _pair(tiny_model(family, **extra))
    refs = _refs()
    lone = [teacher_forced(pair, r) for r in refs]
    for ref, a, b in zip(refs, lone, teacher_forced_batch(pair, refs), strict=True):
        for name in ("target_logits", "draft_logits"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape == (ref.n_tokens, VOCAB)
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
        assert b.routing.shape == a.routing.shape
        for cache in ("target_cache", "draft_cache"):
            mine, theirs = getattr(b, cache), getattr(a, cache)
            assert mine.get_seq_length() == theirs.get_seq_length() == len(ref.all_ids)
            for x, y in zip(theirs.layers, mine.layers, strict=True):
                assert type(x) is type(y)
                torch.testing.assert_close(y.keys, x.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(y.values, x.values, rtol=1e-4, atol=1e-5)


# --- extraction rows ---------------------------------------------------------------------------


@torch.no_grad()
def _router_logits(pair: ModelPair, ids: list[int]) -> torch.Tensor:
    """The lone path's router logits, [positions, MoE layers, experts] (qwen3_moe's gate)."""
    out, handles = [], []
    for layer in pair.spec.moe_layers:
        gate = pair.target.model.layers[layer].mlp.gate
        handles.append(gate.register_forward_hook(lambda m, a, o: out.append(o[0])))
    try:
        pair.target(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(out, dim=1).float()


def _assert_routing_same_or_tie(
    pair, ids: list[int], lone: np.ndarray, batched: np.ndarray, what: str
) -> None:
    """``lone`` / ``batched``: [positions, layers, top_k] for the last positions of ``ids``. A
    flip at one layer changes what later layers see, so only the lowest layer where any position
    differs must be a near-tie of the router: every expert chosen instead is within TIE of the
    lone path's k-th."""
    differs = (lone != batched).any(-1)
    if not differs.any():
        return
    layer = int(np.nonzero(differs.any(0))[0].min())
    logits = _router_logits(pair, ids)[-len(lone) :, layer]
    for pos in np.nonzero(differs[:, layer])[0]:
        row = logits[pos]
        kth = row[lone[pos, layer]].min().item()
        for e in set(batched[pos, layer].tolist()) - set(lone[pos, layer].tolist()):
            assert _near(kth, row[e].item()), f"{what}: position {pos} layer {layer} no near-tie"
    _note(f"{what}: routing at MoE layer {layer}, positions {np.nonzero(differs[:, layer])[0]}")


def _u_distance(probs: torch.Tensor, u: float, token: int) -> float:
    """How far ``u`` is from the inverse-CDF interval that draws ``token`` (0: inside)."""
    cdf = probs.double().cumsum(0) / probs.double().sum()
    lo = cdf[token - 1].item() if token else 0.0
    return max(lo - u, u - cdf[token].item(), 0.0)


def _assert_tail_same_or_tie(pair, ref, forced, spec, lone, batched, what: str) -> None:
    """One tail (rows of the tails table): tokens equal, or the first differing one a near-tie
    of its drawing rule (the rest follows from it); equal tokens route alike or at a near-tie."""
    s, acc = int(spec.s), str(spec.acceptance)
    prefix = list(ref.all_ids[: ref.prompt_len + s])
    a, b = lone["token_id"].tolist(), batched["token_id"].tolist()
    if a == b:
        experts = [np.stack([np.array(e.tolist()) for e in t["experts"]]) for t in (lone, batched)]
        _assert_routing_same_or_tie(pair, prefix + a, *experts, what)
        return
    r = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    if r == 0:  # the first token: from the teacher-forced rows at s
        q = torch.softmax(forced.draft_logits[s] / TEMPERATURE, -1)
        forbidden = torch.tensor([ref.all_ids[ref.prompt_len + s]])
        dist = exclude_token(q.view(1, -1), forbidden)[0]
        if acc == "sampling":
            pi = torch.softmax(forced.target_logits[s].float() / TEMPERATURE, -1)
            residual = residual_probs(q.view(1, -1), pi.view(1, -1))[0]
            dist = residual if residual.sum() > 0 else dist
        logits = forced.draft_logits[s]
    else:
        logits = _last_logits(pair.draft, prefix + a[:r])
        dist = torch.softmax(logits / TEMPERATURE, -1)
    if acc == "greedy":
        top, other = logits[a[r]].item(), logits[b[r]].item()
        assert _near(top, other), f"{what}: greedy tail token {r + 1} is no near-tie"
    else:
        gap = _u_distance(dist, float(uniforms(np.array([spec.key]), r + 1)[0]), b[r])
        assert gap < TIE, f"{what}: {acc} tail token {r + 1}: u is {gap:.2e} from the other's"
    _note(f"{what}: {acc} tail token {r + 1}")


def _assert_rows_same_or_tie(
    pair, ref, mode, seed, lone: SequenceTables, batched: SequenceTables
) -> None:
    assert lone.sequences.equals(batched.sequences) and lone.stats == batched.stats
    a, b = lone.tokens.to_pydict(), batched.tokens.to_pydict()
    assert a["t"] == b["t"] and a["token_id"] == b["token_id"]
    for name in ("draft_prob", "target_prob"):
        assert a[name][0] is None and b[name][0] is None
        np.testing.assert_allclose(b[name][1:], a[name][1:], rtol=1e-5, atol=1e-6, err_msg=name)
    forced = teacher_forced(pair, ref)
    for t in np.nonzero(np.array(a["draft_match"][1:]) != np.array(b["draft_match"][1:]))[0]:
        row, x = forced.draft_logits[t], ref.all_ids[ref.prompt_len + t]
        assert _near(row.max().item(), row[x].item()), f"{ref.seq_id}: draft_match {t + 1}"
        _note(f"{ref.seq_id}: draft_match at t = {t + 1}")
    experts = [np.array(x["experts"]) for x in (a, b)]
    _assert_routing_same_or_tie(pair, list(ref.all_ids), *experts, f"{ref.seq_id} tokens")
    specs = tail_specs(ref.n_tokens, LMAX, mode, seed, ref.seq_id)
    ta, tb = lone.tails.to_pandas(), batched.tails.to_pandas()
    layout = ["seq_id", "mode", "acceptance", "draw", "s", "r", "i", "k", "a"]
    assert ta[layout].equals(tb[layout])
    ends = np.cumsum(specs.length)
    for j, end in enumerate(ends.tolist()):
        rows = slice(end - int(specs.length[j]), end)
        _assert_tail_same_or_tie(
            pair,
            ref,
            forced,
            _Spec(specs, j),
            ta.iloc[rows],
            tb.iloc[rows],
            f"{ref.seq_id} tail {j}",
        )


class _Spec:
    """One tail's fields."""

    def __init__(self, specs, j: int) -> None:
        self.s, self.acceptance, self.key = specs.s[j], specs.acceptance[j], specs.key[j]


@pytest.mark.parametrize("mode", ["shared", "paper"])
def test_batched_extraction_rows_equal_lone_rows(pair, mode):
    refs, seed = _refs(), 3
    kwargs = {"temperature": TEMPERATURE}
    lone = extract_sequences(pair, refs, LMAX, mode, seed, batch_size=1, **kwargs)
    for batch_size in (4, 16):
        batched = extract_sequences(pair, refs, LMAX, mode, seed, batch_size=batch_size, **kwargs)
        for ref, a, b in zip(refs, lone, batched, strict=True):
            _assert_rows_same_or_tie(pair, ref, mode, seed, a, b)


def test_the_near_tie_check_catches_a_real_difference(pair):
    """The checks above are not vacuous: a changed tail token or expert is refused."""
    refs = _refs()[:2]
    lone = extract_sequences(pair, refs, LMAX, "shared", 0, batch_size=1, temperature=TEMPERATURE)
    ref, one = refs[0], lone[0]
    for column in ("token_id", "experts"):
        tails = one.tails.to_pandas()
        if column == "token_id":
            tails.loc[5, column] = (int(tails.loc[5, column]) + 1) % VOCAB
        else:
            e = np.array(tails.loc[5, column].tolist())
            missing = next(x for x in range(pair.spec.num_experts) if x not in e[0])
            e[0, 0] = missing
            tails.at[5, column] = list(e)
        table = pa.Table.from_pandas(tails, schema=one.tails.schema)
        changed = SequenceTables(one.sequences, one.tokens, table, one.stats)
        with pytest.raises(AssertionError, match="no near-tie|u is"):
            _assert_rows_same_or_tie(pair, ref, "shared", 0, one, changed)
