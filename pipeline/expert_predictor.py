"""A light predictor of the experts the target will select for a draft token.

This first predictor is a lookup table learned from routing traces (the extraction's `tokens`
table): for each token id and MoE layer, the top-k experts the router chose most often for it;
unseen tokens get each layer's most used experts. It costs one table lookup per draft token,
needs nothing from the draft's forward pass, and is what the cost-aware policies call.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class TokenExpertPredictor:
    def __init__(self, table: dict[int, np.ndarray], fallback: np.ndarray) -> None:
        self.table = table  # token id -> [layers, top_k]
        self.fallback = fallback  # [layers, top_k]

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[int, np.ndarray]], num_experts: int, top_k: int
    ) -> TokenExpertPredictor:
        """``samples`` yields (token id, experts ``[layers, top_k]``) pairs."""
        counts: dict[int, np.ndarray] = {}
        total = None
        for token, experts in samples:
            layers = experts.shape[0]
            if total is None:
                total = np.zeros((layers, num_experts), dtype=np.int64)
            c = counts.setdefault(int(token), np.zeros((layers, num_experts), dtype=np.int64))
            rows = np.repeat(np.arange(layers), experts.shape[1])
            np.add.at(c, (rows, experts.reshape(-1).astype(np.int64)), 1)
            np.add.at(total, (rows, experts.reshape(-1).astype(np.int64)), 1)
        if total is None:
            raise ValueError("no routing samples to fit the expert predictor on")

        def top(c: np.ndarray) -> np.ndarray:
            # Ties broken by the global frequency, so rare tokens lean on common experts.
            score = c * (total.max() + 1) + total
            return np.sort(np.argsort(-score, axis=1, kind="stable")[:, :top_k], axis=1)

        return cls({t: top(c) for t, c in counts.items()}, top(np.zeros_like(total)))

    def predict(self, token: int) -> np.ndarray:
        return self.table.get(int(token), self.fallback)

    def overlap_accuracy(self, samples: Iterable[tuple[int, np.ndarray]]) -> float:
        """Mean over samples and layers of |predicted ∩ actual| / top_k."""
        hits = total = 0
        for token, experts in samples:
            pred = self.predict(token)
            for layer in range(experts.shape[0]):
                hits += len(set(pred[layer].tolist()) & set(experts[layer].tolist()))
                total += experts.shape[1]
        return hits / total if total else float("nan")
