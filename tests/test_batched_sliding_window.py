"""The batched engine refuses every model whose attention slides: GPT-OSS's sliding layers
(layer_types) and a Mixtral-style config's ``sliding_window`` with no layer_types, for the
target and the draft alike; a packed forward would show a sequence its whole context."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pipeline.decode.batched import BatchedEngine, sliding_window
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.registry import make_policy
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import ModelPair
from pipeline.models.slots import SlotCache
from tests.tinymodels import tiny_model

WINDOW = 4


def _pair(target, draft) -> ModelPair:
    family = target.config.model_type
    return ModelPair(
        target,
        draft,
        None,
        moe_spec(target.config),
        torch.device("cpu"),
        torch.float32,
        "eager",
        family,
        family,
    )


def test_a_mixtral_style_sliding_window_is_refused_with_a_way_out():
    windowed = tiny_model("mixtral", sliding_window=WINDOW)
    assert getattr(windowed.config, "layer_types", None) is None  # the case GPT-OSS's misses
    plain = tiny_model("mixtral")
    for target, draft in ((windowed, plain), (plain, windowed)):
        with pytest.raises(ValueError, match=f"mixtral, sliding_window {WINDOW}.*max_batch=1"):
            BatchedEngine(_pair(target, draft))
    # One generation at a time decodes it (the engine of its own honours the window).
    gen = SpeculativeEngine(_pair(windowed, windowed)).generate([3, 1, 2], make_policy("ar"), 4)
    assert len(gen.tokens) <= 4


def test_configs_that_do_not_slide_are_accepted():
    for config in (
        tiny_model("mixtral").config,  # sliding_window None
        tiny_model("qwen2_moe").config,  # sliding_window 0, but every layer full attention
        tiny_model("qwen3_moe", sliding_window=WINDOW).config,  # use_sliding_window False
    ):
        assert sliding_window(config) is None, config.model_type
    BatchedEngine(_pair(tiny_model("mixtral"), tiny_model("mixtral")))
    assert sliding_window(tiny_model("gpt_oss").config) == "sliding_attention layers"


def test_why_the_window_is_refused():
    """Past the window, the packed forward over a slot cache (what batching runs) and the
    model alone disagree: the packed mask shows the whole context."""
    model = tiny_model("mixtral", sliding_window=WINDOW)
    ids = torch.arange(1, 3 * WINDOW).tolist()
    with torch.no_grad():
        alone = model(
            torch.tensor([ids]), past_key_values=DynamicCache(config=model.config)
        ).logits[0, -1]
        cache = SlotCache(model.config.num_hidden_layers, rows=1, capacity=32)
        row = cache.acquire()
        mask = cache.plan([(row, len(ids), None)], model.dtype, torch.device("cpu"))
        packed = model(
            torch.tensor([ids]),
            past_key_values=cache,
            attention_mask=mask,
            position_ids=torch.tensor([list(range(len(ids)))]),
        ).logits[0, -1]
    assert not torch.allclose(alone, packed, atol=1e-3)
