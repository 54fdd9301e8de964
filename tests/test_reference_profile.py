"""Reference sequences and the routing profile, checked against direct computations."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pipeline.data.prompts import Prompt
from pipeline.data.references import build_references, greedy_continuation
from pipeline.extract.routing_profile import RoutingProfile, reference_routing, window_union_sizes
from pipeline.models.adapters import moe_spec
from tests.tinymodels import tiny_model


def test_window_union_sizes_equal_direct_set_unions():
    rng = np.random.default_rng(0)
    routing = np.sort(rng.choice(16, size=(30, 3, 4)), axis=-1).astype(np.int16)
    for window in range(1, 9):
        sizes = window_union_sizes(routing, 16, window)
        for start, layer in itertools.product(range(30 - window + 1), range(3)):
            expected = len(set(routing[start : start + window, layer].reshape(-1).tolist()))
            assert sizes[start, layer] == expected


def test_profile_counts_and_window_means():
    spec = moe_spec(tiny_model("mixtral").config)
    profile = RoutingProfile(spec, max_window=3)
    routing = np.array([[[0, 1]] * 3, [[0, 2]] * 3, [[3, 4]] * 3], dtype=np.int16)
    profile.add(routing)
    assert profile.tokens == 3
    assert profile.experts_used_per_layer() == [5, 5, 5]
    means = profile.mean_unique_in_window()
    assert means[1] == 2.0 and means[2] == 3.5 and means[3] == 5.0


@torch.no_grad()
def test_greedy_continuation_equals_transformers_generate():
    model = tiny_model("olmoe")
    prompt = [5, 17, 42, 9]
    ours = greedy_continuation(model, prompt, 12, eos_id=None)
    theirs = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=12,
        min_new_tokens=12,
        pad_token_id=0,
    )
    assert ours == theirs[0, len(prompt) :].tolist()


class _CharTokenizer:
    """Enough of a tokenizer for build_references: one id per character."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + (ord(c) % 200) for c in text]}


def test_build_references_given_and_greedy():
    model = tiny_model("qwen2_moe")
    prompts = [
        Prompt("a", "x", "def f():", "test", reference="  return 1"),
        Prompt("b", "y", "print(", "test"),
    ]
    refs = build_references(prompts, model, _CharTokenizer(), max_new_tokens=5, use_given=True)
    assert [r.source for r in refs] == ["given", "greedy"]
    assert refs[0].response_ids == tuple(1 + ord(c) % 200 for c in "  ret")
    assert refs[1].n_tokens == 5 and refs[1].prompt_len == 6
    spec = moe_spec(model.config)
    routing = reference_routing(model, spec, refs[1])
    assert routing.shape == (6, spec.num_moe_layers, spec.top_k)
    assert routing.dtype == np.int16
