"""The vLLM side of jobs.calibrate_vllm: decode token prompts through vLLM with the calibration
drafter drafting a random length k ~ U{0..K} per row and step (a designed spread of positions
per pass at every batch size), recording every step (pipeline.vllm_spec.calibration_drafter).

    python -m pipeline.vllm_spec.calibration_run --spec spec.json   # in the vLLM env
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def run(spec: dict) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.vllm_spec.calibration_drafter import CLASS_PATH, ENV, CalibrationConfig

    record = spec["record"]
    if os.path.exists(record):
        os.remove(record)
    os.environ[ENV] = CalibrationConfig(
        draft=spec["draft"], record=record, seed=spec.get("seed", 0)
    ).to_env()
    llm = LLM(
        model=spec["target"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        max_num_seqs=max(spec["batch_sizes"]),
        seed=0,
        speculative_config={
            "method": "custom_class",
            "model": CLASS_PATH,
            "num_speculative_tokens": spec["k"],
        },
    )
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    start = time.perf_counter()
    for size in spec["batch_sizes"]:
        for wave in range(0, len(prompts), size):
            llm.generate(prompts[wave : wave + size], params, use_tqdm=False)
        print(f"batch size {size}: done at {time.perf_counter() - start:.1f} s", flush=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # the drafter flushes its records
    Path(spec["meta_out"]).write_text(json.dumps({"vllm_version": vllm.__version__}))
    del llm


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pipeline.vllm_spec.calibration_run")
    parser.add_argument("--spec", required=True)
    run(json.loads(Path(parser.parse_args().spec).read_text()))
