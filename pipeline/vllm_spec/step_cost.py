"""What vLLM's engine step costs, as the calibration measures it (``vllm_costmodel.json``; the
cost-aware scheduler's prior: pipeline.vllm_spec.priors).

The form is the batch > 1 model's (pipeline.cost.batch.BatchCost), measured on vLLM's step
instead of our engine's:

* ``T_T(P, U, A, B) = b0 + b_pos P + b_union U + b_ctx A + b_row B``: everything vLLM does
  between two proposals (scheduling, the target's pass over the P scheduled tokens of B rows
  with U the mean union of experts per MoE layer, sampling and verification),
  A = sum_r n_r L_r;
* ``T_D(n) = d0 + d_tok n``: one packed forward of the draft over n tokens, in the
  calibration drafter (pipeline.vllm_spec.calibration_drafter);
* ``S(B) = s0 + s_row B``: the drafter's own work besides its forwards, for B rows;
* ``U(P) = E - (E - k) r^(P - 1)``.

Measured by jobs.calibrate_vllm (the router's choices captured with a hook on vLLM's MoE
gates in that run), and bound like every cost model to what it was measured on: its
provenance (device, dtype, checkpoints, vLLM version, the engine's OpenMP threads) is saved
with it, and the scheduler takes it as a prior only on the device it was measured on.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from pipeline.cost.batch import BatchCost
from pipeline.cost.provenance import checkpoint_fingerprint


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
