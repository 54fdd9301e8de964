"""The verification-cost model read by the oracle and the online policies (DESIGN section 3):
``T_T(m, U, L) = beta0(m) + alpha(m) U + c L`` and ``T_D(k) = a k + b``, in milliseconds."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class CostModel:
    beta0: dict[int, float]
    alpha: dict[int, float]
    c: float
    draft_a: float
    draft_b: float
    meta: dict[str, Any] = field(default_factory=dict)  # device, dtype, fit quality ...

    def t_target(self, m: int, u_bar: float, ctx_len: float) -> float:
        if m not in self.beta0:
            known = ", ".join(map(str, sorted(self.beta0)))
            raise KeyError(f"the cost model has no coefficients for m = {m} (calibrated: {known})")
        return self.beta0[m] + self.alpha[m] * u_bar + self.c * ctx_len

    def t_draft(self, k: int) -> float:
        return self.draft_a * k + self.draft_b if k > 0 else 0.0

    @property
    def max_m(self) -> int:
        return max(self.beta0)

    def missing_m(self, ms: Iterable[int]) -> list[int]:
        return sorted(set(ms) - self.beta0.keys())

    def missing_m_message(self, ms: Iterable[int]) -> str:
        missing = self.missing_m(ms)
        known = ", ".join(map(str, sorted(self.beta0)))
        return (f"the cost model has no coefficients for m = {', '.join(map(str, missing))} "
                f"(calibrated: {known}); calibrate K up to {max(missing) - 1} with "
                f"python -m jobs.calibrate --ks 0-{max(missing) - 1}")  # fmt: skip

    def require_m(self, ms: Iterable[int], purpose: str) -> CostModel:
        """Every m in ``ms`` must be calibrated (checked where the model is loaded, so that no
        decode or solve meets a missing m halfway); ``purpose`` says who needs them."""
        ms = list(ms)
        if self.missing_m(ms):
            raise ValueError(f"{purpose} needs m = {min(ms)}..{max(ms)}, but "
                             + self.missing_m_message(ms))  # fmt: skip
        return self

    def to_json(self) -> dict[str, Any]:
        clash = {"beta0", "alpha", "c", "draft"} & self.meta.keys()
        if clash:
            raise ValueError(f"cost-model metadata may not use the keys {sorted(clash)}")
        return {
            "beta0": {str(m): v for m, v in sorted(self.beta0.items())},
            "alpha": {str(m): v for m, v in sorted(self.alpha.items())},
            "c": self.c,
            "draft": {"a": self.draft_a, "b": self.draft_b},
            **self.meta,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        try:
            meta = {k: v for k, v in data.items() if k not in ("beta0", "alpha", "c", "draft")}
            return cls(
                beta0={int(m): float(v) for m, v in data["beta0"].items()},
                alpha={int(m): float(v) for m, v in data["alpha"].items()},
                c=float(data["c"]),
                draft_a=float(data["draft"]["a"]),
                draft_b=float(data["draft"]["b"]),
                meta=meta,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a specbound cost model: {exc!r}") from exc

    @classmethod
    def load(
        cls, path: str | Path, need_m: Iterable[int] | None = None, purpose: str = "the caller"
    ) -> CostModel:
        """The one loader: read ``path`` (a costmodel.json from jobs.calibrate) and check that
        it covers every m in ``need_m``, naming the missing ones."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"no cost model at {path}; run python -m jobs.calibrate and pass its costmodel.json"
            ) from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the cost model {path}: {exc}") from exc
        try:
            model = cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        return model if need_m is None else model.require_m(need_m, purpose)
