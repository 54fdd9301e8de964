"""The verification-cost model read by the oracle and the online policies (DESIGN section 3):
``T_T(m, U, L) = beta0(m) + alpha(m) U + c L`` and ``T_D(k) = a k + b``, in milliseconds."""

from __future__ import annotations

import json
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
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the cost model {path}: {exc}") from exc
        return cls.from_json(data)
