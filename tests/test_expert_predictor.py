"""The learned expert predictor: its inputs line up with what the online drafter holds, the
paper's loss, training on a learnable routing, save/load, and the factory's errors. (That the
cost-aware policies built through the factory with it decode plain greedy text is
tests/test_policy_registry.py: the same pair and predictor.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.cost.model import CostModel
from pipeline.data.references import ReferenceSequence, greedy_continuation
from pipeline.data.shards import write_shard
from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.artifacts import PolicyArtifacts, load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.randomness import TorchRandom
from pipeline.decode.types import SamplingConfig
from pipeline.extract.rows import extract_sequence
from pipeline.models.adapters import MoESpec
from pipeline.predictor.model import ExpertMLP, LearnedExpertPredictor, overlap
from pipeline.predictor.training import (
    RoutingSamples,
    layerwise_cross_entropy,
    learned_accuracy,
    load_samples,
    split_by_sequence,
    table_accuracy,
    train,
)
from tests.test_engine import perturbed_pair

SPEC = MoESpec("test", (0, 1, 2), num_experts=8, top_k=2, shared_experts=False)


def test_layerwise_cross_entropy_matches_the_formula():
    logits = torch.randn(2, 3, 8)
    experts = torch.tensor([[[0, 1], [2, 3], [4, 5]], [[7, 6], [0, 3], [1, 1]]])
    logp = torch.log_softmax(logits, -1)
    by_hand = 0.0
    for t in range(2):
        for layer in range(3):
            by_hand -= sum(0.5 * float(logp[t, layer, e]) for e in experts[t, layer])
    assert math.isclose(float(layerwise_cross_entropy(logits, experts)), by_hand / 2, rel_tol=1e-5)


def test_overlap_counts_shared_experts():
    pred = np.array([[[0, 1], [2, 3]]])
    assert overlap(pred, np.array([[[1, 0], [2, 5]]])) == 0.75


def _synthetic(n_seq: int = 40, length: int = 50, seed: int = 0) -> RoutingSamples:
    """Routing that is a function of the token (layers 0-1) and of the context (layer 2)."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 8, size=(64, 2, 2))
    tokens = rng.integers(0, 64, size=n_seq * length)
    contexts = rng.normal(size=(n_seq * length, 16)).astype(np.float32)
    experts = np.zeros((len(tokens), 3, 2), dtype=np.int64)
    experts[:, :2] = table[tokens]
    experts[:, 2, 0] = np.where(contexts[:, 0] > 0, 1, 5)
    experts[:, 2, 1] = np.where(contexts[:, 1] > 0, 2, 6)
    seq_ids = np.repeat(np.array([f"s{j}" for j in range(n_seq)], dtype=object), length)
    return RoutingSamples(seq_ids, tokens, contexts, experts)


def test_training_learns_token_and_context_routing_better_than_the_table():
    samples = _synthetic()
    train_set, test_set = split_by_sequence(samples, 0.2, seed=0)
    assert not set(train_set.seq_ids) & set(test_set.seq_ids)
    result = train(train_set, test_set, vocab_size=64, spec=SPEC, epochs=12, seed=0)
    assert result.losses[-1] < result.losses[0]
    acc = learned_accuracy(result.predictor, test_set)
    # The table cannot see the context (layer 2 is a coin flip for it); the MLP can.
    assert acc > 0.9
    assert acc > table_accuracy(train_set, test_set, SPEC) + 0.05


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    predictor = LearnedExpertPredictor(ExpertMLP(50, 16, 3, 8), top_k=2, meta={"note": "x"})
    ctx = [torch.randn(16), None]
    before = predictor.predict_many([3, 7], ctx)
    loaded = LearnedExpertPredictor.load(predictor.save(tmp_path / "p"))
    assert np.array_equal(loaded.predict_many([3, 7], ctx), before)
    assert before.shape == (2, 3, 2)
    assert loaded.meta == {"note": "x"}
    with pytest.raises(FileNotFoundError, match="jobs.train_predictor"):
        LearnedExpertPredictor.load(tmp_path / "missing")


def test_training_contexts_are_the_online_drafters_states(checkpoints, tmp_path):
    """Sample t's context must be the hidden state the drafter holds when it proposes x_t."""
    from pipeline.models.loading import load_pair

    pair = load_pair(checkpoints.target, checkpoints.draft)
    prompt = checkpoints.tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    response = greedy_continuation(pair.target, prompt, 12, eos_id=None)
    ref = ReferenceSequence("s0", "c", "greedy", tuple(prompt), tuple(response))
    tables = extract_sequence(pair, ref, 1, "shared", 0)
    write_shard(
        tmp_path, 0, {"sequences": tables.sequences, "tokens": tables.tokens, "tails": tables.tails}
    )
    samples = load_samples(tmp_path, pair, pair.spec)
    assert len(samples) == len(response) + 1  # x_0 .. x_N
    drafter = Drafter(pair, SamplingConfig(), TorchRandom(0))
    committed = list(prompt)
    for t in range(1, len(response) + 1):
        drafter.begin(committed)
        # x_t is proposed from the state after x_{t-1}, the last committed token.
        assert torch.allclose(drafter.hidden[-1], torch.from_numpy(samples.contexts[t]), atol=1e-4)
        drafter.end()
        committed.append(response[t - 1])
    # root_context: the state after the second-to-last committed token, x_N's context.
    drafter.begin(committed)
    assert torch.allclose(drafter.root_context, torch.from_numpy(samples.contexts[-1]), atol=1e-4)
    assert np.array_equal(samples.tokens[1:], response)


def _artifacts(pair, lam: float = 500.0) -> PolicyArtifacts:
    torch.manual_seed(0)
    spec = pair.spec
    hidden = pair.draft.config.hidden_size
    predictor = LearnedExpertPredictor(
        ExpertMLP(pair.draft.config.vocab_size, hidden, spec.num_moe_layers, spec.num_experts),
        spec.top_k,
    )
    cost = CostModel(
        {m: 4 + 0.2 * m for m in range(1, 10)}, {m: 0.3 for m in range(1, 10)}, 0.001, 0.4, 0.1
    )
    return PolicyArtifacts(predictor, cost, lam)


def test_factory_errors_are_specific():
    pair = perturbed_pair("qwen3_moe", noise=0.3)
    art = _artifacts(pair)
    with pytest.raises(ValueError, match="unknown policy 'nope'.*marginal"):
        make_policy("nope")
    with pytest.raises(ValueError, match="lambda must be > 0"):
        make_policy("marginal", art, lam=-1.0)
    with pytest.raises(ValueError, match="max_k must lie in"):
        make_policy("marginal", art, max_k=50)
    with pytest.raises(ValueError, match="bad knobs for policy 'ecospec'"):
        make_policy("ecospec", art, colour=3)
    with pytest.raises(ValueError, match="gamma must be >= 2"):  # the root + one draft node
        make_policy("ecospec", art, gamma=1)
    with pytest.raises(ValueError, match="the target has 6 x 32"):
        art.check_target(6, 32)


def test_committed_artifacts_load_and_fit_the_embedded_target():
    from pipeline.models.adapters import moe_spec
    from pipeline.models.loading import DEFAULT_TARGET, load_config

    art = load_artifacts()
    spec = moe_spec(load_config(DEFAULT_TARGET))
    art.check_target(spec.num_moe_layers, spec.num_experts)
    assert art.lam > 0 and art.cost.max_m >= 2
    assert art.predictor.meta["report"]["held_out_topk_overlap"] > 0.5
