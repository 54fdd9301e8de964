"""EAGLE-3 heads: both checkpoint formats load to the same head, a head of a published
checkpoint's shape (random weights, no download) loads and drafts, a head trained for another
verifier is refused before any weight is read, and decoding with a head is lossless: greedy
text equals plain greedy decoding for chains and trees, the head's cache after every step is
what a fresh pass over the committed text computes, and sampled tokens follow the target's
distribution (chi-square)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.head_drafter import HeadDrafter
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.adapters import moe_spec
from pipeline.models.eagle3 import Eagle3Config, Eagle3Head, HeadCache
from pipeline.models.eagle3_formats import (
    HeadFormatError,
    head_format,
    load_head,
    read_config,
    save_head,
)
from pipeline.models.eagle3_verifier import VerifierMismatchError
from pipeline.models.features import FeatureTap
from pipeline.models.loading import ModelPair, load_pair
from pipeline.models.random_moe import layout_config
from tests.tinymodels import tiny_head, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def head_pair(target, head, name: str = "tiny") -> ModelPair:
    return ModelPair(
        target,
        head,
        None,
        moe_spec(target.config),
        torch.device("cpu"),
        torch.float32,
        "eager",
        name,
        name + "-eagle3",
    )


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3_moe", seed=1)


def _outputs(head: Eagle3Head, target) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, target.config.vocab_size, (1, 7), generator=gen)
    feats = torch.randn(1, 7, 3 * target.config.hidden_size, generator=gen)
    with torch.no_grad():
        return head(ids, feats, torch.arange(7).view(1, -1), HeadCache())


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_both_formats_load_to_the_same_head(tmp_path, target, fmt):
    head = tiny_head(target, draft_vocab=200)
    save_head(head, tmp_path / fmt, fmt)
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3"
        assert config["transformer_layer_config"]["hidden_size"] == 64
        assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert "verifier" in config["speculators_config"]
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["draft_vocab_size"] == 200
    from safetensors import safe_open

    with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    assert f"{prefix}self_attn.q_proj.weight" in names and {"fc.weight", "d2t", "t2d"} <= names
    assert head_format(tmp_path / fmt) == fmt
    loaded = load_head(tmp_path / fmt, target)
    for a, b in zip(_outputs(head, target), _outputs(loaded, target), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_reduced_draft_vocabulary_maps_into_the_targets(target):
    head = tiny_head(target, draft_vocab=200)
    logits, _ = _outputs(head, target)
    finite = torch.isfinite(logits[0])
    kept = torch.arange(200) + head.d2t
    assert finite[:, kept].all() and finite.sum(-1).eq(200).all()
    assert set(logits[0].argmax(-1).tolist()) <= set(kept.tolist())
    assert head.t2d.sum() == 200 and head.t2d[kept].all()


@pytest.mark.parametrize(("draft_vocab", "masked"), [(200, True), (None, False)])
def test_a_reduced_vocabulary_heads_drafter_says_its_logits_are_masked(target, draft_vocab, masked):
    """The statistics read the logits only where no id is -inf (features._top_stats)."""
    head = tiny_head(target, draft_vocab=draft_vocab)
    session = SpeculativeEngine(head_pair(target, head)).start(
        [3, 9, 27], make_policy("fixed", k=2)
    )
    assert session.drafter.masked_logits is masked
    session.step()
    assert bool(torch.isinf(session.drafter.logits).any()) is masked


def test_a_head_without_embeddings_shares_the_targets(tmp_path, target):
    head = tiny_head(target)
    save_head(head, tmp_path / "h", "speculators", include_embed=False)
    loaded = load_head(tmp_path / "h", target)
    torch.testing.assert_close(loaded.embed_tokens.weight, target.get_input_embeddings().weight)


def test_broken_heads_get_specific_errors(tmp_path, target):
    with pytest.raises(HeadFormatError, match="not an EAGLE-3 head"):
        read_config(tmp_path)  # no config at all
    head = tiny_head(target)
    save_head(head, tmp_path / "h", "specforge")
    (tmp_path / "h" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(HeadFormatError, match="cannot read"):
        load_head(tmp_path / "h", target)
    with pytest.raises(ValueError, match="unknown head format"):
        save_head(head, tmp_path / "x", "medusa")


# A published Qwen3-30B-A3B EAGLE-3 head's shape (hidden 2048, 32 heads over 4 KV heads of
# 128, FFN 6144, a reduced draft vocabulary): its layer at full size, the vocabularies and
# the target's depth and experts scaled down so that the CPU test stays small.
REAL_HEAD = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
)
SCALED_TARGET = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, vocab_size=1024)


def test_a_published_shape_head_loads_drafts_and_refuses_another_verifier(tmp_path, target):
    config = layout_config("qwen3-30b-a3b", **SCALED_TARGET)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    big = AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    cfg = Eagle3Config(
        **REAL_HEAD,
        vocab_size=1024,
        draft_vocab_size=256,
        target_hidden_size=2048,
        aux_layer_ids=(0, 1, 2),
        verifier_name="Qwen/Qwen3-30B-A3B",
        verifier_architectures=("Qwen3MoeForCausalLM",),
    )
    head = Eagle3Head(cfg).eval()
    save_head(head, tmp_path / "head", "speculators", include_embed=False)
    loaded = load_head(tmp_path / "head", big)
    assert loaded.fc.weight.shape == (2048, 3 * 2048)
    pair = head_pair(big, loaded, "qwen3-30b-a3b-scaled")
    prompt = [5, 17, 300, 2, 9]
    gen = SpeculativeEngine(pair).generate(prompt, make_policy("fixed", k=3), 4, stop_at_eos=False)
    assert gen.tokens == greedy_continuation(big, prompt, 4, eos_id=None)
    assert sum(s.drafted for s in gen.steps) >= 3

    # The same head against the tiny target: refused, naming what does not fit.
    with pytest.raises(VerifierMismatchError, match="Qwen/Qwen3-30B-A3B.*width 2048.*64"):
        load_head(tmp_path / "head", target)


def test_load_pair_refuses_a_head_for_another_target_before_loading(tmp_path, checkpoints):
    other = tiny_model("qwen3_moe", seed=0, vocab_size=64)
    save_head(tiny_head(other), tmp_path / "head", "specforge")
    with pytest.raises(VerifierMismatchError, match="vocabulary has 64 ids"):
        load_pair(checkpoints.target, tmp_path / "head", device="cpu")


def test_load_pair_takes_a_head_as_the_draft(tmp_path, checkpoints):
    pair = load_pair(checkpoints.target, checkpoints.draft, device="cpu")
    save_head(tiny_head(pair.target), tmp_path / "head", "speculators")
    with_head = load_pair(checkpoints.target, tmp_path / "head", device="cpu")
    assert with_head.draft_is_head and not pair.draft_is_head
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        with_head.require_draft_model("transformers' assisted generation")


POLICIES = [
    ("fixed", {"k": 3}),
    ("fixed", {"k": 1}),
    ("confidence", {"threshold": 0.3, "max_k": 4}),
    ("tree", {"depth": 3, "branch": 2, "gamma": 6}),
]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_greedy_decoding_with_a_head_equals_plain_greedy(family):
    target = tiny_model(family, seed=2)
    pair = head_pair(target, tiny_head(target, seed=3, draft_vocab=200))
    engine = SpeculativeEngine(pair)
    rng = np.random.default_rng(0)
    prompts = [[7], *(rng.integers(1, 256, size=n).tolist() for n in (2, 5, 9))]
    for prompt in prompts:
        expected = greedy_continuation(target, prompt, 14, eos_id=None)
        for name, knobs in POLICIES:
            gen = engine.generate(prompt, make_policy(name, **knobs), 14, stop_at_eos=False)
            assert gen.tokens == expected, (family, name, knobs, prompt)


def test_the_heads_cache_after_each_step_is_a_fresh_pass_over_the_committed_text(target):
    head = tiny_head(target, seed=4)
    pair = head_pair(target, head)
    session = SpeculativeEngine(pair).start([3, 9, 27, 81], make_policy("tree", depth=2))
    tap = FeatureTap(target, head.cfg.aux_layer_ids)
    try:
        for _ in range(5):
            session.step()
            drafter: HeadDrafter = session.drafter
            committed = session.committed
            with torch.no_grad():
                target(torch.tensor([committed[:-1]]))
                feats = tap.latest()
                n = len(committed) - 1
                cache = HeadCache()
                head(
                    torch.tensor([committed[1:]]),
                    feats,
                    torch.arange(n).view(1, -1),
                    cache,
                )
            # The drafter catches up lazily: what it holds is a prefix of the fresh pass.
            held = len(drafter.cache)
            assert held <= n
            torch.testing.assert_close(drafter.cache.keys, cache.keys[..., :held, :])
            torch.testing.assert_close(drafter.cache.values, cache.values[..., :held, :])
    finally:
        tap.remove()


def test_sampling_with_a_head_follows_the_target_distribution():
    """T = 1, fixed k = 2 over a four-token vocabulary: the first two generated tokens'
    counts against the target's own joint distribution (chi-square, 2000 generations)."""
    target = tiny_model("qwen3_moe", seed=5, vocab_size=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    head = tiny_head(target, seed=6)
    pair = head_pair(target, head)
    prompt = [3, 1, 2]
    with torch.no_grad():
        first = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        joint = torch.zeros(4, 4)
        for a in range(4):
            second = target(torch.tensor([[*prompt, a]])).logits[0, -1].softmax(-1)
            joint[a] = first[a] * second
    engine = SpeculativeEngine(pair)
    counts = np.zeros(16)
    runs = 2000
    for seed in range(runs):
        policy = make_policy("fixed", k=2)
        gen = engine.generate(prompt, policy, 2, SamplingConfig(1.0), seed=seed, stop_at_eos=False)
        counts[gen.tokens[0] * 4 + gen.tokens[1]] += 1
    probs = joint.flatten().double().numpy()
    expected = probs / probs.sum() * runs
    assert chisquare(counts, expected).pvalue > 1e-3
