"""The speculative engine: rollback leaves both caches as a fresh prefill; every step records
the draft forwards its proposal ran; seeds, top-p, stop strings, max tokens and EOS. (That
greedy output equals plain greedy output, for every policy at its defaults and at the knob
settings of POLICIES below (its KNOB_CASES), on two tiny MoE families and the embedded
models, is tests/test_policy_registry.py; that sampling preserves the target's distribution,
for every policy, is proved exactly in tests/test_lossless_sampling.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pipeline.cost.model import CostModel
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import ModelPair
from pipeline.predictor.model import ExpertMLP, LearnedExpertPredictor
from tests.tinymodels import tiny_model

POLICIES = {
    "ar": {},
    "fixed": {"k": 3},
    "heuristic": {},
    "confidence": {"threshold": 0.3, "max_k": 6},
    "tree": {"depth": 3, "branch": 2, "gamma": 7},  # 6 draft nodes + the root
}


def perturbed_pair(
    family: str, noise: float, vocab: int = 256, seed: int = 0, sharpen: float = 1.0
) -> ModelPair:
    """A draft that agrees with the target often but not always: the target plus noise.
    ``sharpen`` scales both models' logits (random tiny models are nearly uniform; confidence
    thresholds need peaked distributions)."""
    target = tiny_model(family, seed=seed, vocab_size=vocab)
    draft = tiny_model(family, seed=seed, vocab_size=vocab)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
        for model in (target, draft):
            model.lm_head.weight.mul_(sharpen)
    return ModelPair(
        target,
        draft,
        None,
        moe_spec(target.config),
        torch.device("cpu"),
        torch.float32,
        "eager",
        family,
        family + "-noisy",
    )


def _fresh_cache(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("policy", ["fixed", "tree"])
def test_rollback_leaves_caches_as_a_fresh_prefill(policy):
    pair = perturbed_pair("qwen3_moe", noise=0.3)
    session = SpeculativeEngine(pair).start(
        [4, 8, 15, 16, 23], make_policy(policy, **POLICIES[policy])
    )
    for _ in range(6):
        session.step()
        fresh = _fresh_cache(pair.target, session.committed[:-1])
        assert session.target_cache.get_seq_length() == len(session.committed) - 1
        for got, want in zip(session.target_cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
        # The draft cache keeps only committed tokens, exactly as a prefill of them.
        n = session.drafter.cache.get_seq_length()
        assert n <= len(session.committed)
        fresh_d = _fresh_cache(pair.draft, session.committed[:n])
        for got, want in zip(session.drafter.cache.layers, fresh_d.layers, strict=True):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)


def _marginal_artifacts(pair: ModelPair, lam: float) -> PolicyArtifacts:
    torch.manual_seed(0)
    spec, vocab = pair.spec, pair.draft.config.vocab_size
    predictor = LearnedExpertPredictor(
        ExpertMLP(vocab, pair.draft.config.hidden_size, spec.num_moe_layers, spec.num_experts),
        spec.top_k,
    )
    cost = CostModel(
        {m: 4 + 0.2 * m for m in range(1, 14)}, {m: 0.3 for m in range(1, 14)}, 0.001, 0.4, 0.1
    )
    return PolicyArtifacts(predictor, cost, lam)


def test_each_step_records_the_draft_forwards_its_proposal_ran():
    """fixed: k; ar: 0; tree policies: their depth; confidence and marginal: k + 1 when the
    stop fired after looking at position k (1 for marginal's plain step), k at max_k."""
    pair = perturbed_pair("qwen3_moe", noise=0.3, vocab=16, sharpen=6.0)
    art = _marginal_artifacts(pair, lam=8.0)
    engine = SpeculativeEngine(pair)
    early = {"confidence": {"threshold": 0.3, "max_k": 4}, "marginal": {"lam": 8.0, "max_k": 3}}
    seen: dict[str, set[tuple[int, int]]] = {name: set() for name in early}
    for temperature in (0.0, 1.0):
        for prompt in ([5, 9, 2], [10, 3, 7, 7], [1, 2, 3, 4, 5, 6]):
            for name, knobs in [
                ("ar", {}),
                ("fixed", {"k": 3}),
                ("heuristic", {}),
                ("tree", {"depth": 3, "branch": 2, "gamma": 5}),
                ("ecospec", {"depth": 2}),
                *early.items(),
            ]:
                gen = engine.generate(
                    prompt,
                    make_policy(name, art, **knobs),
                    16,
                    SamplingConfig(temperature),
                    seed=1,
                    stop_at_eos=False,
                )
                for rec in gen.steps:
                    if name in early:
                        max_k = knobs["max_k"]
                        want = max_k if rec.drafted == max_k else rec.drafted + 1
                        seen[name].add((rec.drafted, max_k))
                    else:
                        want = {
                            "ar": 0,
                            "fixed": 3,
                            "heuristic": rec.drafted,
                            "tree": 3,
                            "ecospec": 2,
                        }[name]
                    assert rec.draft_forwards == want, (name, temperature, rec)
    # Both kinds of chain were seen: stopped early (k < max_k) and full.
    for name, pairs in seen.items():
        assert any(k < m for k, m in pairs) and any(k == m for k, m in pairs), (name, pairs)
    # A lambda below every ratio: plain steps only, each after one look (one forward).
    plain = engine.generate(
        [4, 4], make_policy("marginal", art, lam=0.5, max_k=3), 4, stop_at_eos=False
    )
    assert [(r.drafted, r.draft_forwards) for r in plain.steps] == [(0, 1)] * 4


def test_the_same_seed_gives_the_same_sample_and_another_seed_another():
    pair = perturbed_pair("qwen3_moe", noise=0.8, vocab=16, sharpen=2.0)
    engine = SpeculativeEngine(pair)

    def run(seed: int) -> list[int]:
        return engine.generate(
            [3, 7, 1],
            make_policy("fixed", k=3),
            12,
            SamplingConfig(temperature=1.0),
            seed=seed,
            stop_at_eos=False,
        ).tokens

    assert run(5) == run(5)
    assert len({tuple(run(seed)) for seed in range(4)}) > 1


def test_top_p_and_temperature():
    cfg = SamplingConfig(temperature=1.0, top_p=0.5)
    probs = cfg.probs(torch.log(torch.tensor([0.6, 0.3, 0.1])))
    assert probs.tolist() == pytest.approx([1.0, 0.0, 0.0])
    probs = SamplingConfig(temperature=1.0, top_p=0.8).probs(
        torch.log(torch.tensor([0.6, 0.3, 0.1]))
    )
    assert probs.tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])


def test_policy_errors_are_specific():
    with pytest.raises(ValueError, match="unknown policy 'eco'"):
        make_policy("eco")
    with pytest.raises(ValueError, match="bad knobs for policy 'fixed'"):
        make_policy("fixed", depth=3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        make_policy("fixed", k=0)


def test_stop_strings_max_tokens_and_eos_on_the_embedded_models():
    from pipeline.models.loading import load_pair

    pair = load_pair()
    engine = SpeculativeEngine(pair)
    ids = pair.tokenizer("def add(a, b):\n    return", add_special_tokens=False)["input_ids"]
    plain = engine.generate(ids, make_policy("fixed", k=3), max_new_tokens=40)
    assert len(plain.tokens) <= 40 and plain.finish_reason in ("length", "eos")
    assert plain.text == pair.tokenizer.decode(plain.tokens)
    stop = plain.text[5:8]  # a string the greedy continuation is known to contain
    gen = engine.generate(ids, make_policy("tree"), max_new_tokens=40, stop=[stop])
    assert gen.finish_reason == "stop"
    assert stop not in gen.text and plain.text.startswith(gen.text)
    short = engine.generate(ids, make_policy("heuristic"), max_new_tokens=3)
    assert len(short.tokens) == 3 and short.tokens == plain.tokens[:3]
    # EOS: make the EOS id the first greedy token, and generation ends right there.
    first = plain.tokens[0]
    pair.tokenizer.eos_token_id, saved = first, pair.tokenizer.eos_token_id
    try:
        eos = engine.generate(ids, make_policy("fixed", k=2), max_new_tokens=10)
    finally:
        pair.tokenizer.eos_token_id = saved
    assert eos.finish_reason == "eos" and eos.tokens == [first]
