"""The acceptance model the `throughput` policy reads (``acceptance.json`` beside a draft).

Per decoding mode (``greedy``: T = 0; ``sampled``: T > 0) two logistic regressions over
features.FEATURE_NAMES:

* ``current``: P(the token about to be drafted from q_i is accepted), read once q_i is known;
* ``next``: the same for position i + 1, read from q_i before the forward that would compute
  q_{i+1}, so that deciding whether to extend a chain costs no draft forward.

``recent`` is an exponential moving average (``decay``) of the generation's acceptance
outcomes, starting from the mode's training mean (``prior``). ``union_by_m[m - 1]`` is the
mean number of experts per layer a verification pass of m positions computes (from the
target's routing on the traced text), what the cost model's T_T(m, U, L) is priced with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.acceptance.features import FEATURE_NAMES, feature_vector, logistic

MODES = ("greedy", "sampled")
RECENT = FEATURE_NAMES.index("recent")


@dataclass(frozen=True)
class ModeModel:
    current: list[float]
    next: list[float]
    prior: float  # training mean of the labels: recent acceptance before any outcome
    # A SpecDec++-style acceptance head (the `specdec` peer): logistic weights over
    # [1, the draft's last-layer state that produced q_i].
    head: list[float] = field(default_factory=list)
    # The `current` model's logit without its recent-acceptance term over the training
    # positions, at the 5th, 15th, ..., 95th percentiles: how acceptance spreads with what the
    # draft will show, for deciding whether a look at the next distribution is worth its
    # forward before paying for it.
    spread: list[float] = field(default_factory=list)
    # Added to the `next` logit at T = 0 when the text was here before
    # (pipeline.acceptance.repeats): [the draft agreed after it, it missed]; empty: not fitted.
    repeat: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(FEATURE_NAMES)
        for name in ("current", "next"):
            if len(getattr(self, name)) < n:
                raise ValueError(
                    f"{name}: expected {n} weights ({', '.join(FEATURE_NAMES)}) "
                    "and optionally one per dimension of the draft's hidden "
                    "state"
                )
        if len(self.repeat) not in (0, 2):
            raise ValueError(
                f"repeat: expected 2 weights (agreed, missed) or none, got {len(self.repeat)}"
            )
        # The hidden-state parts as tensors once: a prediction is then one dot product.
        parts = {
            name: torch.tensor(w) if len(w) else None
            for name, w in (
                ("current", self.current[n:]),
                ("next", self.next[n:]),
                ("head", self.head[1:]),
            )
        }
        if parts["current"] is not None and parts["next"] is not None:
            parts["both"] = torch.stack([parts["current"], parts["next"]], dim=1)  # [H, 2]
        object.__setattr__(self, "_hidden_weights", parts)

    def hidden_weights(self, name: str) -> torch.Tensor | None:
        """The hidden-state weights of ``current``, ``next``, ``both`` ([H, 2]) or ``head``;
        None when the model reads no hidden state."""
        return self._hidden_weights.get(name)  # type: ignore[attr-defined]

    def _hidden_product(self, hidden: torch.Tensor, name: str) -> Any:
        """``hidden`` (the draft's state) times the hidden-state weights ``name``, as floats.
        The state is moved and cast only when it must be: this runs once per draft forward,
        where even a conversion that does nothing costs microseconds."""
        if not hidden.is_cpu or hidden.dtype != torch.float32:
            hidden = hidden.float().cpu()
        return (hidden @ self._hidden_weights[name]).tolist()  # type: ignore[attr-defined]

    def chain_view(
        self,
        stats: list[float],
        recent: float,
        hidden: torch.Tensor | None,
        n: int,
        decay: float,
        offset: float = 0.0,
        repeat: bool | None = None,
        products: list[float] | None = None,
    ) -> tuple[float, list[float]]:
        """P(the token about to be drafted is accepted), then the `next` model for the n
        tokens after it along the path where each is accepted (what a later token's worth is
        conditional on): recent acceptance rising by an accepted outcome per token, the
        draft's features as seen here. One product against the hidden state serves both
        models (a decision per draft token); ``offset`` is added to every logit (the policy's
        online correction); ``repeat``: the outcome after this context's last occurrence
        (RepeatMemory.outcome; None: unknown or not asked), read by `next` when fitted;
        ``products``: ``hidden`` times the two hidden-state weight vectors, when the caller
        has them already (native_reads)."""
        both = self._hidden_weights.get("both")  # type: ignore[attr-defined]
        if both is None or hidden is None:
            z_cur = self._logit("current", stats, recent, hidden)
            z_next = self._logit("next", stats, recent, hidden)
        else:
            k = len(FEATURE_NAMES)
            f = feature_vector(stats, recent)
            h_cur, h_next = products or self._hidden_product(hidden, "both")
            z_cur = h_cur + sum(w * x for w, x in zip(self.current[:k], f, strict=True))
            z_next = h_next + sum(w * x for w, x in zip(self.next[:k], f, strict=True))
        z_cur, z_next = z_cur + offset, z_next + offset
        if repeat is not None and self.repeat:
            z_next += self.repeat[0] if repeat else self.repeat[1]
        w_recent = self.next[RECENT]
        z_next -= w_recent * recent
        later = []
        for _ in range(n):
            later.append(logistic(z_next + w_recent * recent))
            recent = decay * recent + (1 - decay)
        return logistic(z_cur), later

    def _logit(
        self, name: str, stats: list[float], recent: float, hidden: torch.Tensor | None
    ) -> float:
        weights = getattr(self, name)
        n = len(FEATURE_NAMES)
        z = sum(w * x for w, x in zip(weights[:n], feature_vector(stats, recent), strict=True))
        part = self._hidden_weights[name]  # type: ignore[attr-defined]
        if part is not None:
            if hidden is None:
                raise ValueError("this acceptance model reads the draft's hidden state")
            z += self._hidden_product(hidden, name)
        return z

    def p_head(self, hidden: torch.Tensor) -> float:
        """The SpecDec++-style head's P(accept) from the draft's state alone."""
        part = self._hidden_weights["head"]  # type: ignore[attr-defined]
        if part is None:
            raise ValueError(
                "the acceptance model has no SpecDec++-style head; retrain it "
                "with python -m jobs.train_acceptance"
            )
        return logistic(self.head[0] + self._hidden_product(hidden, "head"))

    def spread_floor(self, recent: float) -> float:
        """min(spread_around(recent)), with one logistic (it is monotone)."""
        w_recent = self.current[RECENT]
        low = min(self.spread) if self.spread else self.current[0]
        return logistic(low + w_recent * recent)

    def spread_around(self, recent: float) -> list[float]:
        """The next token's acceptance at each percentile of the spread, given recent
        acceptance (the `current` model, its draft-dependent part at the percentile)."""
        w_recent = self.current[RECENT]
        if not self.spread:
            return [logistic(self.current[0] + w_recent * recent)]
        return [logistic(z + w_recent * recent) for z in self.spread]


@dataclass(frozen=True)
class AcceptanceModel:
    modes: dict[str, ModeModel]
    union_by_m: list[float]
    decay: float = 0.8
    meta: dict[str, Any] = field(default_factory=dict)

    def mode(self, greedy: bool) -> ModeModel:
        key = "greedy" if greedy else "sampled"
        if key not in self.modes:
            raise ValueError(
                f"the acceptance model has no {key} part; retrain it with "
                f"python -m jobs.train_acceptance"
            )
        return self.modes[key]

    def head_probability(self, greedy: bool, hidden: torch.Tensor) -> float:
        return self.mode(greedy).p_head(hidden)

    def union(self, m: int) -> float:
        """Mean experts per layer of a pass of m positions (the last value beyond the table)."""
        return self.union_by_m[min(m, len(self.union_by_m)) - 1]

    def to_json(self) -> dict[str, Any]:
        return {
            "feature_names": list(FEATURE_NAMES),
            "decay": self.decay,
            "modes": {k: asdict(v) for k, v in self.modes.items()},
            "union_by_m": self.union_by_m,
            "meta": self.meta,
        }

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> AcceptanceModel:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"no acceptance model at {path}; train one with python -m jobs.train_acceptance"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from exc
        if raw.get("feature_names") != list(FEATURE_NAMES):
            raise ValueError(
                f"{path}: features {raw.get('feature_names')} differ from this "
                f"version's {list(FEATURE_NAMES)}; retrain"
            )
        modes = {k: ModeModel(**v) for k, v in raw["modes"].items() if k in MODES}
        if not modes or not raw.get("union_by_m"):
            raise ValueError(f"{path}: no modes or no union_by_m; retrain")
        return cls(
            modes, [float(u) for u in raw["union_by_m"]], float(raw["decay"]), raw.get("meta", {})
        )
