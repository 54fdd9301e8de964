"""The routing profile of a target on reference text: which experts it uses, and how fast the
union of experts grows over windows of consecutive tokens (what makes long drafts expensive)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch

from pipeline.data.references import ReferenceSequence
from pipeline.data.schemas import experts_to_numpy
from pipeline.data.shards import read_table
from pipeline.models.adapters import MoESpec
from pipeline.models.routing import forward_with_routing


@torch.no_grad()
def reference_routing(model, spec: MoESpec, ref: ReferenceSequence) -> np.ndarray:
    """Experts selected for ``x_0 .. x_N`` in one teacher-forced pass: ``[N+1, layers, top_k]``
    int16 (``x_0``, the prompt's last token, is the first verified position of round 0)."""
    device = next(model.parameters()).device
    ids = torch.tensor([ref.all_ids], device=device)
    _, routing = forward_with_routing(model, spec, ids, use_cache=False)
    return routing[0, ref.prompt_len - 1 :].to(torch.int16).cpu().numpy()


def window_union_sizes(routing: np.ndarray, num_experts: int, window: int) -> np.ndarray:
    """Unique experts per layer for every window of ``window`` consecutive positions:
    ``[positions - window + 1, layers]``."""
    positions, layers, _ = routing.shape
    if positions < window:
        return np.zeros((0, layers), dtype=np.int64)
    hit = np.zeros((positions, layers, num_experts), dtype=bool)
    np.put_along_axis(hit, routing.astype(np.int64), True, axis=2)
    union = hit[: positions - window + 1].copy()
    for offset in range(1, window):
        union |= hit[offset : positions - window + 1 + offset]
    return union.sum(axis=2)


@dataclass
class RoutingProfile:
    spec: MoESpec
    tokens: int = 0
    usage: np.ndarray = field(init=False)  # [layers, experts] selection counts
    window_sums: dict[int, float] = field(default_factory=dict)
    window_counts: dict[int, int] = field(default_factory=dict)
    max_window: int = 8

    def __post_init__(self) -> None:
        self.usage = np.zeros((self.spec.num_moe_layers, self.spec.num_experts), dtype=np.int64)

    def add(self, routing: np.ndarray) -> None:
        positions, layers, _ = routing.shape
        self.tokens += positions
        for layer in range(layers):
            self.usage[layer] += np.bincount(
                routing[:, layer].reshape(-1).astype(np.int64), minlength=self.spec.num_experts
            )
        for w in range(1, self.max_window + 1):
            sizes = window_union_sizes(routing, self.spec.num_experts, w)
            self.window_sums[w] = self.window_sums.get(w, 0.0) + float(sizes.mean(axis=1).sum())
            self.window_counts[w] = self.window_counts.get(w, 0) + len(sizes)

    def experts_used_per_layer(self) -> list[int]:
        return [int((row > 0).sum()) for row in self.usage]

    def top_share_per_layer(self) -> list[float]:
        """Share of selections that go to the layer's most used expert (1/E is perfect balance)."""
        return [float(row.max() / max(1, row.sum())) for row in self.usage]

    def mean_unique_in_window(self) -> dict[int, float]:
        """Mean over windows and MoE layers of the number of unique experts in the window."""
        return {
            w: self.window_sums[w] / self.window_counts[w]
            for w in sorted(self.window_sums)
            if self.window_counts[w]
        }

    def as_dict(self) -> dict:
        return {
            "family": self.spec.family,
            "moe_layers": list(self.spec.moe_layers),
            "num_experts": self.spec.num_experts,
            "top_k": self.spec.top_k,
            "tokens": self.tokens,
            "experts_used_per_layer": self.experts_used_per_layer(),
            "top_expert_share_per_layer": self.top_share_per_layer(),
            "mean_unique_experts_by_window": {
                str(w): v for w, v in self.mean_unique_in_window().items()
            },
            "usage_counts": self.usage.tolist(),
        }

    def report(self) -> str:
        spec = self.spec
        lines = [
            f"routing profile: {spec.family} target, {spec.num_moe_layers} MoE layers x "
            f"{spec.num_experts} experts, top-{spec.top_k}, over {self.tokens:,} reference tokens",
            "",
            "  layer  experts used  busiest expert share",
        ]
        for layer, used, share in zip(
            spec.moe_layers,
            self.experts_used_per_layer(),
            self.top_share_per_layer(),
            strict=True,
        ):
            lines.append(f"  {layer:>5}  {used:>6}/{spec.num_experts:<5}  {share:>10.1%}")
        lines += ["", "  window  mean unique experts/layer  (x top-k)"]
        for w, mean in self.mean_unique_in_window().items():
            lines.append(f"  {w:>6}  {mean:>14.2f}            {mean / spec.top_k:>5.2f}")
        return "\n".join(lines)


def extraction_profile(extract_dir: Path, spec: MoESpec) -> RoutingProfile:
    """The routing profile of an extraction's reference tokens (its ``tokens`` table): the
    same profile as from the models, without running them again."""
    profile = RoutingProfile(spec)
    tokens = read_table(extract_dir, "tokens")
    for seq_id in sorted(set(tokens.column("seq_id").to_pylist())):
        rows = tokens.filter(pc.equal(tokens.column("seq_id"), seq_id)).sort_by("t")
        profile.add(experts_to_numpy(rows.column("experts"), spec.num_moe_layers, spec.top_k))
    return profile


def profile_references(
    model, spec: MoESpec, refs: list[ReferenceSequence], max_window: int = 8, log=print
) -> RoutingProfile:
    """The routing profile of reference sequences, one teacher-forced pass each (progress
    every 8 sequences)."""
    started = time.perf_counter()
    profile = RoutingProfile(spec, max_window=max_window)
    for n, ref in enumerate(refs, 1):
        profile.add(reference_routing(model, spec, ref))
        if n % 8 == 0 or n == len(refs):
            elapsed = time.perf_counter() - started
            log(f"  {n}/{len(refs)} sequences, {profile.tokens:,} tokens, {elapsed:.0f}s")
    return profile
