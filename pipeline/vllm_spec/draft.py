"""The project's draft model inside the calibration drafter (pipeline.vllm_spec.
calibration_drafter): every row's new tokens in ONE packed forward (pipeline.models.slots), so
a draft round costs one forward for the whole batch."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipeline.models.slots import SlotCache, segmented_attention


class PackedDraft:
    def __init__(self, path: str | Path, device: str = "cpu", rows: int = 16) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="sdpa"
        ).to(device)
        self.model.eval()
        self.device = torch.device(device)
        self.cache = SlotCache(self.model.config.num_hidden_layers, rows=rows, capacity=256)
        self.forward_s = 0.0  # time in forwards since the owner last reset it
        self.records: list[tuple[int, int, float]] = []  # (rows, tokens, ms) per forward

    def acquire(self) -> int:
        return self.cache.acquire()

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    def length(self, slot: int) -> int:
        return self.cache.length[slot]

    def cut(self, slot: int, length: int) -> None:
        """Keep the first ``length`` cached positions of ``slot`` (a rollback: no copy)."""
        self.cache.length[slot] = min(self.cache.length[slot], length)

    @torch.no_grad()
    def forward(self, parts: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each (slot, new tokens) after its cached context in one packed forward; the
        logits [parts, vocab] and last-layer hidden states [parts, hidden] after each part's
        last token."""
        start = time.perf_counter()
        cache = self.cache
        starts = [cache.length[slot] for slot, _ in parts]
        mask = cache.plan(
            [(slot, len(ids), None) for slot, ids in parts], self.model.dtype, self.device
        )
        positions: list[int] = []
        ids: list[int] = []
        last: list[int] = []
        for (_, new), begin in zip(parts, starts, strict=True):
            positions += range(begin, begin + len(new))
            ids += new
            last.append(len(ids) - 1)
        kw = {
            "past_key_values": cache,
            "use_cache": True,
            "attention_mask": mask,
            "position_ids": torch.tensor([positions], device=self.device),
        }
        with segmented_attention(self.model, cache):
            out = self.model.model(torch.tensor([ids], device=self.device), **kw)
        hidden = out.last_hidden_state[0, last]
        logits = self.model.lm_head(hidden).float()
        elapsed = time.perf_counter() - start
        self.forward_s += elapsed
        self.records.append((len(parts), len(ids), elapsed * 1e3))
        return logits, hidden
