"""The speculative engine is lossless: greedy output equals plain greedy output, sampling
preserves the target's distribution, and rollback leaves both caches as a fresh prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import DynamicCache

from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import ModelPair
from tests.tinymodels import tiny_model

POLICIES = {
    "ar": {},
    "fixed": {"k": 3},
    "heuristic": {},
    "confidence": {"threshold": 0.3, "max_k": 6},
    "tree": {"depth": 3, "branch": 2, "gamma": 6},
}


def perturbed_pair(family: str, noise: float, vocab: int = 256, seed: int = 0) -> ModelPair:
    """A draft that agrees with the target often but not always: the target plus noise."""
    target = tiny_model(family, seed=seed, vocab_size=vocab)
    draft = tiny_model(family, seed=seed, vocab_size=vocab)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    return ModelPair(target, draft, None, moe_spec(target.config), torch.device("cpu"),
                     torch.float32, "eager", family, family + "-noisy")  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_greedy_output_equals_plain_greedy_for_every_policy(family):
    pair = perturbed_pair(family, noise=0.3)
    engine = SpeculativeEngine(pair)
    rng = np.random.default_rng(0)
    accepted = {name: 0 for name in POLICIES}
    for _ in range(20):
        prompt = rng.integers(1, 256, size=int(rng.integers(2, 9))).tolist()
        expected = greedy_continuation(pair.target, prompt, 16, eos_id=None)
        for name, knobs in POLICIES.items():
            gen = engine.generate(prompt, make_policy(name, **knobs), max_new_tokens=16,
                                  stop_at_eos=False)  # fmt: skip
            assert gen.tokens == expected, (family, name, prompt)
            accepted[name] += sum(s.accepted for s in gen.steps)
    # Not vacuous: the noisy draft gets tokens accepted under every drafting policy.
    assert all(accepted[name] > 0 for name in POLICIES if name != "ar"), accepted


@pytest.mark.slow
def test_greedy_equality_on_the_embedded_models():
    from pipeline.data.prompts import load_humaneval
    from pipeline.models.loading import load_pair

    pair = load_pair()
    engine = SpeculativeEngine(pair)
    for prompt in load_humaneval(limit=20):
        ids = pair.tokenizer(prompt.text, add_special_tokens=False)["input_ids"][-256:]
        expected = greedy_continuation(pair.target, ids, 12, eos_id=None)
        for name, knobs in POLICIES.items():
            gen = engine.generate(ids, make_policy(name, **knobs), max_new_tokens=12,
                                  stop_at_eos=False)  # fmt: skip
            assert gen.tokens == expected, (prompt.prompt_id, name)


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


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "tree"])
def test_sampling_preserves_the_target_distribution(policy):
    vocab, runs = 12, 2500
    pair = perturbed_pair("qwen3_moe", noise=0.8, vocab=vocab, seed=4)
    prompt = [3, 7, 1]
    with torch.no_grad():
        p1 = torch.softmax(pair.target(torch.tensor([prompt])).logits[0, -1], -1)
        nxt = torch.tensor([[*prompt, x] for x in range(vocab)])
        p2_given = torch.softmax(pair.target(nxt).logits[:, -1], -1)
    p2 = (p1[:, None] * p2_given).sum(0)
    engine = SpeculativeEngine(pair)
    knobs = {"k": 3} if policy == "fixed" else {"depth": 2, "branch": 3, "gamma": 6}
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    accepted = 0
    for seed in range(runs):
        gen = engine.generate(prompt, make_policy(policy, **knobs), max_new_tokens=2,
                              sampling=SamplingConfig(temperature=1.0), seed=seed,
                              stop_at_eos=False)  # fmt: skip
        first[gen.tokens[0]] += 1
        second[gen.tokens[1]] += 1
        accepted += gen.steps[0].accepted
    assert accepted > runs * 0.2  # drafts really were accepted, often
    for observed, expected in ((first, p1), (second, p2)):
        exp = expected.double().numpy() * runs
        keep = exp >= 5  # chi-square needs expected counts >= 5: pool the rest
        obs = np.append(observed[keep], observed[~keep].sum())
        exp = np.append(exp[keep], exp[~keep].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        exp = exp / exp.sum() * obs.sum()  # float32 probabilities: sum exactly to the runs
        assert stats.chisquare(obs, exp).pvalue > 1e-3, (policy, obs, exp)


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
