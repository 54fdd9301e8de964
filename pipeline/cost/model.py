"""The verification-cost model read by the oracle and the online policies (docs/contract.md):
``T_T(m, U, L) = beta0(m) + alpha(m) U + c L`` and ``T_D(n) = a n + b`` over n draft
forwards, in milliseconds; and the check that it is used on the setup it was measured on."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.cost.batch import BatchCost

log = logging.getLogger(__name__)

# What check_measured_on compares (pipeline.cost.provenance builds these dicts). The paths
# target_model / draft_model are shown beside their fingerprints, never compared: they differ
# between clones of one checkpoint.
PROVENANCE_FIELDS = (
    "device",
    "device_name",
    "dtype",
    "experts_implementation",
    "target_fingerprint",
    "draft_fingerprint",
)
_PATH_OF = {"target_fingerprint": "target_model", "draft_fingerprint": "draft_model"}
ALLOW_HINT = (
    "recalibrate on this setup (python -m jobs.calibrate) and use its costmodel.json, "
    "or go on anyway: --allow-costmodel-mismatch in the jobs, allow_mismatch=True in "
    "the library"
)


class CostModelMismatchError(ValueError):
    """The cost model was measured on another device, dtype, experts implementation or
    checkpoints than the ones it is about to price."""


def _same(key: str, measured: Any, used: Any) -> bool:
    if key == "device":  # cuda:0 and cuda:1 are the same kind of device
        return str(measured).split(":")[0] == str(used).split(":")[0]
    return measured == used


def select_mode(modes: list[dict[str, Any]], temperature: float, top_p: float) -> dict | None:
    """The calibrated mode that prices decoding at ``temperature`` / ``top_p``: greedy for
    T = 0; for T > 0 the sampled mode of the nearest temperature, one with a nucleus (top-p
    < 1, a sort per distribution) preferred for a request with one and the other way round.
    None: no mode of that kind was calibrated."""
    if temperature <= 0:
        return next((e for e in modes if e["temperature"] == 0), None)
    sampled = [e for e in modes if e["temperature"] > 0]
    same = [e for e in sampled if (e["top_p"] < 1) == (top_p < 1)] or sampled
    return min(same, key=lambda e: abs(e["temperature"] - temperature), default=None)


@dataclass
class CostModel:
    beta0: dict[int, float]
    alpha: dict[int, float]
    c: float
    draft_a: float
    draft_b: float
    meta: dict[str, Any] = field(default_factory=dict)  # device, dtype, fit quality ...
    source: str = field(default="", compare=False)  # the file it was loaded from (messages)

    def t_target(self, m: int, u_bar: float, ctx_len: float) -> float:
        if m not in self.beta0:
            known = ", ".join(map(str, sorted(self.beta0)))
            raise KeyError(f"the cost model has no coefficients for m = {m} (calibrated: {known})")
        return self.beta0[m] + self.alpha[m] * u_bar + self.c * ctx_len

    def t_draft(self, n: int) -> float:
        """The draft time of a proposal that ran ``n`` draft FORWARDS (StepRecord.draft_forwards),
        not of its k drafted tokens: a fixed chain of k runs k, a chain that looked at one more
        distribution before stopping at k runs k + 1, a look that ended in k = 0 runs 1, and
        no draft (n = 0) costs nothing."""
        return self.draft_a * n + self.draft_b if n > 0 else 0.0

    def for_sampling(self, temperature: float, top_p: float = 1.0) -> CostModel:
        """The prices of a generation decoded at ``temperature`` and ``top_p``: the calibrated
        mode that matches it (pipeline.cost.modes: its draft line, and its acceptance walk
        added to every verification), or this model as it is when the file has no such mode
        (calibrated in one mode, or before modes were recorded)."""
        entry = select_mode(self.meta.get("modes") or [], temperature, top_p)
        return self if entry is None else self.with_mode(entry)

    def with_mode(self, entry: dict[str, Any]) -> CostModel:
        """This model priced in one ``modes`` entry."""
        walk_a, walk_b = float(entry["accept"]["a"]), float(entry["accept"]["b"])
        return replace(
            self,
            beta0={m: b + walk_a * m + walk_b for m, b in self.beta0.items()},
            draft_a=float(entry["draft"]["a"]),
            draft_b=float(entry["draft"]["b"]),
            meta={**self.meta, "priced_mode": {k: entry[k] for k in ("temperature", "top_p")}},
        )

    @property
    def batch(self) -> BatchCost | None:
        """The batch > 1 model (jobs.calibrate_batch), if this file has one."""
        data = self.meta.get("batch")
        return BatchCost.from_json(data) if data else None

    @property
    def max_m(self) -> int:
        return max(self.beta0)

    def missing_m(self, ms: Iterable[int]) -> list[int]:
        return sorted(set(ms) - self.beta0.keys())

    def missing_m_message(self, ms: Iterable[int]) -> str:
        missing = self.missing_m(ms)
        known = ", ".join(map(str, sorted(self.beta0)))
        return (
            f"the cost model has no coefficients for m = {', '.join(map(str, missing))} "
            f"(calibrated: {known}); calibrate K up to {max(missing) - 1} with "
            f"python -m jobs.calibrate --ks 0-{max(missing) - 1}"
        )

    def require_m(self, ms: Iterable[int], purpose: str) -> CostModel:
        """Every m in ``ms`` must be calibrated (checked where the model is loaded, so that no
        decode or solve meets a missing m halfway); ``purpose`` says who needs them."""
        ms = list(ms)
        if self.missing_m(ms):
            raise ValueError(
                f"{purpose} needs m = {min(ms)}..{max(ms)}, but " + self.missing_m_message(ms)
            )
        return self

    def provenance_mismatches(self, provenance: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``field -> (measured on, used with)`` for every field of PROVENANCE_FIELDS present in
        ``provenance`` that differs. Fields absent from ``provenance`` are not compared; a
        value None there means unknown and matches nothing; a field this cost model does not
        record (a file from before provenance was recorded) differs with measured None."""
        out = {}
        for key in PROVENANCE_FIELDS:
            if key not in provenance:
                continue
            measured, used = self.meta.get(key), provenance[key]
            if measured is None or used is None or not _same(key, measured, used):
                out[key] = (measured, used)
        return out

    def check_measured_on(
        self, provenance: dict[str, Any], allow_mismatch: bool = False
    ) -> list[str]:
        """Refuse to price a setup other than the one measured: a CostModelMismatchError (a
        ValueError) lists every differing field and how to go on anyway; with
        ``allow_mismatch`` the same text is logged as a warning and returned as lines."""
        diffs = self.provenance_mismatches(provenance)
        if not diffs:
            return []
        lines = []
        for key, (measured, used) in diffs.items():
            path = _PATH_OF.get(key)
            used_text = "unknown" if used is None else used
            if path:
                where = provenance.get(path)
                used_text += f" ({where})" if used else f" (no checkpoint on disk at {where})"
            if measured is None:
                lines.append(
                    f"{key}: not recorded in the cost model (written before it "
                    f"recorded its provenance), used with {used_text}"
                )
                continue
            measured_text = f"{measured} ({self.meta.get(path)})" if path else measured
            lines.append(f"{key}: measured on {measured_text}, used with {used_text}")
        name = f"the cost model {self.source}" if self.source else "the cost model"
        text = f"{name} was measured on another setup than the one it is used with:\n  "
        text += "\n  ".join(lines)
        if not allow_mismatch:
            raise CostModelMismatchError(f"{text}\nTo fix: {ALLOW_HINT}.")
        log.warning("%s\ngoing on anyway, as allowed: its prices are another setup's", text)
        return lines

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
            model = cls(
                beta0={int(m): float(v) for m, v in data["beta0"].items()},
                alpha={int(m): float(v) for m, v in data["alpha"].items()},
                c=float(data["c"]),
                draft_a=float(data["draft"]["a"]),
                draft_b=float(data["draft"]["b"]),
                meta=meta,
            )
            if meta.get("batch") is not None:
                BatchCost.from_json(meta["batch"])  # a bad batch section fails here, named
            return model
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a specbound cost model: {exc!r}") from exc

    @classmethod
    def load(
        cls,
        path: str | Path,
        need_m: Iterable[int] | None = None,
        purpose: str = "the caller",
        provenance: dict[str, Any] | None = None,
        allow_mismatch: bool = False,
    ) -> CostModel:
        """The one loader: read ``path`` (a costmodel.json from jobs.calibrate), check that it
        covers every m in ``need_m`` (naming the missing ones) and, given the ``provenance`` of
        the setup it will price (pipeline.cost.provenance), that it was measured on it."""
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
        model.source = str(path)
        if provenance is not None:
            model.check_measured_on(provenance, allow_mismatch)
        return model if need_m is None else model.require_m(need_m, purpose)
