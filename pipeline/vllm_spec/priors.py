"""What the scheduler knows about a pair before its first step: the offline acceptance model's
mean acceptance per decoding mode (``acceptance.json``: jobs.train_acceptance) and vLLM's step
costs with the expected union of experts (``vllm_costmodel.json``: jobs.calibrate_vllm).

Both are looked up beside the draft (or EAGLE-3 head), then in its parent folder when the
artifact there names this draft (the embedded ``models/draft`` keeps its artifacts in
``models/``). A step-cost model measured on another kind of device is not used as a prior
(its numbers are another machine's); online refinement starts from the weak default then. A
drafter no calibration measured (an EAGLE-3 head beside a draft model's calibration) takes the
target's terms and ``U(P)`` from a calibration of the same target in the same folders, and its
draft terms only as a weak guess (``draft_cost_measured`` False), learned online.
Reads JSON only: it runs in vLLM's engine process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("greedy", "sampled")
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


def mode_of(temperature: float | None) -> str:
    return "greedy" if temperature is None or temperature < SAMPLING_EPS else "sampled"


@dataclass(frozen=True)
class Priors:
    rates: dict[str, float] = field(default_factory=dict)  # mode -> per-token acceptance
    cost: tuple[float, ...] | None = None  # online_step_cost.TERMS' order
    union: tuple[int, int, float] | None = None  # E, top_k, r of U(P) = E - (E - k) r^(P-1)
    sources: tuple[str, ...] = ()
    draft_cost_measured: bool = True  # d0, d_row measured for this drafter (not another's)


def _named(body: dict[str, Any], role: str) -> str:
    pair = body.get("meta", {}).get("pair") or body.get("provenance") or {}
    return Path(str(pair.get(role, ""))).name


def _find(
    draft: Path, name: str, target: str | None = None
) -> tuple[Path, dict[str, Any], bool] | None:
    """(path, body, whether it was measured for this draft). With ``target``, failing one for
    this draft, one in the same folders that names that target (another drafter's)."""
    other = None
    for folder in (draft, draft.parent):
        path = folder / name
        if not path.is_file():
            continue
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if folder == draft or _named(body, "draft_model") == draft.name:
            return path, body, True
        if target and other is None and _named(body, "target_model") == Path(target).name:
            other = (path, body, False)
    return other


def find_artifact(draft: Path, name: str) -> Path | None:
    """The artifact ``name`` of this draft (beside it, or in its parent folder naming it)."""
    found = _find(Path(draft), name)
    return found[0] if found is not None else None


def load_priors(draft: str | Path | None, device: str = "cpu", target: str | None = None) -> Priors:
    """The pair's priors (empty where an artifact is missing or does not fit); ``target``: the
    engine's model, for a calibration of that target made with another drafter."""
    if not draft:
        return Priors()
    draft = Path(draft)
    rates: dict[str, float] = {}
    cost = union = None
    measured_draft = True
    sources: list[str] = []
    found = _find(draft, "acceptance.json")
    if found is not None:
        path, body, _ = found
        for mode in MODES:
            prior = body.get("modes", {}).get(mode, {}).get("prior")
            if isinstance(prior, int | float) and 0.0 < prior < 1.0:
                rates[mode] = float(prior)
        if rates:
            sources.append(str(path))
    found = _find(draft, "vllm_costmodel.json", target)
    if found is not None:
        path, body, measured_draft = found
        measured = body.get("provenance", {}).get("device", "")
        c = body.get("cost", {})
        if measured.split(":")[0] == device.split(":")[0] and "b0" in c:
            # the row term where the calibration fitted one (0 before it did); s0 + s_row B:
            # the calibrating drafter's own work
            cost = (
                c["b0"], c["b_pos"], c["b_union"], c.get("b_row", 0.0),
                c["d0"], c["d_tok"], c.get("s0", 0.0), c.get("s_row", 0.0),
            )  # fmt: skip
            union = (int(c["experts"]), int(c["top_k"]), float(c["union_decay"]))
            sources.append(str(path))
    return Priors(rates, cost, union, tuple(sources), measured_draft or cost is None)
