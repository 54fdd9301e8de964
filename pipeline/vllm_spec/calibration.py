"""jobs.calibrate_vllm's pipeline: decode prompts in vLLM (its own environment, by subprocess)
with the calibration drafter drawing random draft lengths, then fit the step records
(pipeline.vllm_spec.step_fit) and save ``vllm_costmodel.json`` with its provenance."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.cost.batch import BatchCost
from pipeline.vllm_spec import step_cost
from pipeline.vllm_spec.calibration_drafter import CalibrationConfig, check_draft
from pipeline.vllm_spec.env import engine_env, vllm_python
from pipeline.vllm_spec.step_fit import fit_step_cost, read_records


@dataclass
class VllmCalibration:
    cost: BatchCost
    fit: dict[str, Any]
    provenance: dict[str, Any]
    seconds: float


def calibrate_vllm(
    target: Path,
    draft: Path,
    prompts: list[list[int]],
    batch_sizes: list[int],
    k: int,
    max_tokens: int,
    out: Path,
    seed: int = 0,
) -> VllmCalibration:
    config = json.loads((target / "config.json").read_text())
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if not experts or not top_k:
        raise ValueError(f"{target} is not an MoE checkpoint (no num_experts / top-k)")
    # The drafter's own check, here: in vLLM's worker its error would read "Engine core
    # initialization failed".
    check_draft(CalibrationConfig(draft=str(draft)), target)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="calibrate_vllm_") as tmp:
        spec = {
            "target": str(target.resolve()),
            "draft": str(draft.resolve()),
            "k": k,
            "prompts": prompts,
            "batch_sizes": batch_sizes,
            "max_tokens": max_tokens,
            "seed": seed,
            "record": f"{tmp}/records.jsonl",
            "meta_out": f"{tmp}/meta.json",
            "max_model_len": max(len(p) for p in prompts) + max_tokens + k + 8,
        }
        Path(f"{tmp}/spec.json").write_text(json.dumps(spec))
        cmd = [
            str(vllm_python()),
            "-m",
            "pipeline.vllm_spec.calibration_run",
            "--spec",
            f"{tmp}/spec.json",
        ]
        env = engine_env()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"the vLLM calibration run failed ({done.returncode}):\n" + done.stderr[-3000:]
            )
        records = read_records(Path(spec["record"]))
        version = json.loads(Path(spec["meta_out"]).read_text())["vllm_version"]
    cost, fit = fit_step_cost(records, experts, top_k)
    provenance = step_cost.engine_provenance(target, draft, "float32", "cpu", version)
    provenance.update(
        engine="vllm",
        enforce_eager=True,
        k=k,
        batch_sizes=batch_sizes,
        max_tokens=max_tokens,
        prompts=len(prompts),
        # The engine's OpenMP threads: a step's cost depends on them as on the device.
        omp_threads=int(env["OMP_NUM_THREADS"]),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    step_cost.save(out, cost, provenance, fit)
    return VllmCalibration(cost, fit, provenance, time.perf_counter() - start)
