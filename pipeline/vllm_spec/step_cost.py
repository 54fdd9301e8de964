"""What vLLM's engine step costs, as our proposer's plan prices it (``vllm_costmodel.json``).

The form is the batch > 1 model's (pipeline.cost.batch.BatchCost), measured on vLLM's step
instead of our engine's:

* ``T_T(P, U, A) = b0 + b_pos P + b_union U + b_ctx A``: everything vLLM does between two
  proposals (scheduling, the target's pass over the P scheduled tokens with U the mean union
  of experts per MoE layer, sampling and verification), A = sum_r n_r L_r;
* ``T_D(n) = d0 + d_tok n``: one packed forward of our draft over n tokens, in the proposer;
* ``S(B) = s0 + s_row B``: the proposer's own work besides its forwards, for B rows;
* ``U(P) = E - (E - k) r^(P - 1)``.

Measured by jobs.calibrate_vllm (the router's choices captured with a hook on vLLM's MoE
gates in that run), and bound like every cost model to what it was measured on: the
provenance below is compared with the engine's at start, field by field.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from pipeline.cost.batch import BatchCost
from pipeline.cost.provenance import checkpoint_fingerprint

CALIBRATE_HINT = "measure one with: python -m jobs.calibrate_vllm"
CHECKED = (
    "device",
    "device_name",
    "dtype",
    "target_fingerprint",
    "draft_fingerprint",
    "vllm_version",
)


def engine_provenance(
    target: str | Path, draft: str | Path, dtype: str, device: str, vllm_version: str
) -> dict[str, Any]:
    return {
        "device": device,
        "device_name": platform.processor() or platform.machine(),
        "dtype": dtype.replace("torch.", ""),
        "target_model": str(target),
        "target_fingerprint": checkpoint_fingerprint(target),
        "draft_model": str(draft),
        "draft_fingerprint": checkpoint_fingerprint(draft),
        "vllm_version": vllm_version,
    }


def save(path: Path, cost: BatchCost, provenance: dict[str, Any], fit: dict[str, Any]) -> None:
    body = {"kind": "vllm_step", "cost": cost.to_json(), "provenance": provenance, "fit": fit}
    Path(path).write_text(json.dumps(body, indent=2) + "\n")


def load(
    path: Path,
    here: dict[str, Any] | None = None,
    allow_mismatch: bool = False,
    skip: tuple[str, ...] = (),
) -> tuple[BatchCost, list[str]]:
    """The cost model at ``path``, checked against ``here`` (engine_provenance): a ValueError
    listing every differing field, unless ``allow_mismatch`` (then the list is returned)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no vLLM step cost model at {path}: {CALIBRATE_HINT}")
    try:
        body = json.loads(path.read_text())
        cost = BatchCost.from_json(body["cost"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a vLLM step cost model ({exc}): {CALIBRATE_HINT}") from exc
    differ: list[str] = []
    if here is not None:
        measured = body.get("provenance", {})
        differ = [
            f"{k}: measured on {measured.get(k)!r}, running on {here.get(k)!r}"
            for k in CHECKED
            if k not in skip and measured.get(k) != here.get(k)
        ]
        if differ and not allow_mismatch:
            raise ValueError(
                f"the vLLM step cost model {path} was measured elsewhere ("
                + "; ".join(differ)
                + f"); {CALIBRATE_HINT}, or allow the "
                'mismatch ("allow_mismatch": true)'
            )
    return cost, differ
