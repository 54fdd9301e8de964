"""Light predictors of the experts the target will select for a draft token (EcoSpec section
4.1), behind one interface: ``predict(token, context)`` gives ``[MoE layers, top_k]`` expert ids
and ``predict_many`` does a batch of draft-tree nodes in one call.

``context`` is the draft's last-layer hidden state that produced the token's distribution (the
state after the token's parent). The draft computes it anyway while drafting, so reading it
costs nothing extra; together with the token's own id it carries both what the router mostly
keys on (the token) and the context that moves the rest.

* ``TokenExpertPredictor``: a lookup table (token id -> most frequent experts per layer); the
  baseline, and a fallback that needs no training.
* ``LearnedExpertPredictor``: a two-layer MLP over [token embedding, projected context], trained
  with the paper's layer-wise cross-entropy against uniform targets on the router's selection
  (pipeline.predictor.training). Saved as ``predictor.safetensors`` + ``predictor.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS_FILE = "predictor.safetensors"
CONFIG_FILE = "predictor.json"


class ExpertPredictor(Protocol):
    def predict(self, token: int, context: torch.Tensor | None = None) -> np.ndarray: ...

    def predict_many(
        self, tokens: Sequence[int], contexts: Sequence[torch.Tensor | None] | None = None
    ) -> np.ndarray: ...


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

    def predict(self, token: int, context: torch.Tensor | None = None) -> np.ndarray:
        return self.table.get(int(token), self.fallback)

    def predict_many(
        self, tokens: Sequence[int], contexts: Sequence[torch.Tensor | None] | None = None
    ) -> np.ndarray:
        return np.stack([self.predict(t) for t in tokens])

    def overlap_accuracy(self, samples: Iterable[tuple[int, np.ndarray]]) -> float:
        """Mean over samples and layers of |predicted ∩ actual| / top_k."""
        samples = list(samples)
        if not samples:
            return float("nan")
        pred = self.predict_many([t for t, _ in samples])
        return overlap(pred, np.stack([e for _, e in samples]))


def overlap(predicted: np.ndarray, actual: np.ndarray) -> float:
    """Top-K overlap accuracy of ``[n, layers, top_k]`` expert ids: the mean over tokens and
    layers of |predicted ∩ actual| / top_k (the paper's metric)."""
    hits = (predicted[..., :, None] == actual[..., None, :]).any(-1).sum()
    return float(hits / actual.size)


class ExpertMLP(nn.Module):
    """[embedding(token), W h_context] -> GELU MLP -> routing logits [layers, experts]."""

    def __init__(
        self,
        vocab_size: int,
        context_dim: int,
        layers: int,
        num_experts: int,
        embed_dim: int = 64,
        hidden_dim: int = 256,
    ) -> None:
        super().__init__()
        self.layers, self.num_experts = layers, num_experts
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.context = nn.Linear(context_dim, embed_dim)
        self.mlp = nn.Sequential(
            nn.LayerNorm(2 * embed_dim),
            nn.Linear(2 * embed_dim, hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, layers * num_experts),
        )

    def forward(self, tokens: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.embed(tokens), self.context(contexts)], dim=-1)
        return self.mlp(x).view(-1, self.layers, self.num_experts)


class LearnedExpertPredictor:
    def __init__(self, model: ExpertMLP, top_k: int, meta: dict[str, Any] | None = None) -> None:
        self.model = model.eval()
        self.top_k = top_k
        self.meta = meta or {}
        self.context_dim = model.context.in_features

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def to(self, device: torch.device | str) -> LearnedExpertPredictor:
        self.model.to(device)
        return self

    def _contexts(self, contexts: Sequence[torch.Tensor | None] | None, n: int) -> torch.Tensor:
        rows = []
        for j in range(n):
            ctx = contexts[j] if contexts is not None else None
            # No context (a one-token prompt): zeros, which training also sees for x_0.
            rows.append(
                torch.zeros(self.context_dim, device=self.device)
                if ctx is None
                else ctx.to(self.device, torch.float32)
            )
        return torch.stack(rows)

    @torch.no_grad()
    def predict_many(
        self, tokens: Sequence[int], contexts: Sequence[torch.Tensor | None] | None = None
    ) -> np.ndarray:
        ids = torch.tensor(list(tokens), device=self.device)
        logits = self.model(ids, self._contexts(contexts, len(tokens)))
        top = logits.topk(self.top_k, dim=-1).indices
        return top.sort(dim=-1).values.cpu().numpy()

    def predict(self, token: int, context: torch.Tensor | None = None) -> np.ndarray:
        return self.predict_many([token], [context])[0]

    def save(self, directory: str | Path) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        m = self.model
        config = {
            "vocab_size": m.embed.num_embeddings,
            "context_dim": self.context_dim,
            "layers": m.layers,
            "num_experts": m.num_experts,
            "embed_dim": m.embed.embedding_dim,
            "hidden_dim": m.mlp[1].out_features,
            "top_k": self.top_k,
            **self.meta,
        }
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in m.state_dict().items()},
            out / WEIGHTS_FILE,
        )
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return out

    @classmethod
    def load(
        cls, directory: str | Path, device: str | torch.device = "cpu"
    ) -> LearnedExpertPredictor:
        d = Path(directory)
        if not (d / CONFIG_FILE).is_file() or not (d / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(
                f"no expert predictor in {d} (expected {CONFIG_FILE} and {WEIGHTS_FILE}; "
                "train one with python -m jobs.train_predictor)"
            )
        config = json.loads((d / CONFIG_FILE).read_text())
        shape = ("vocab_size", "context_dim", "layers", "num_experts", "embed_dim", "hidden_dim")
        model = ExpertMLP(*(int(config[k]) for k in shape))
        model.load_state_dict(load_file(d / WEIGHTS_FILE))
        meta = {k: v for k, v in config.items() if k not in (*shape, "top_k")}
        return cls(model.to(device), int(config["top_k"]), meta)
