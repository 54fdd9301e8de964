"""Running a scenarios script in the vLLM environment from a test (the project's environment
has no vLLM): the script writes its results as JSON, which the test reads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline.vllm_spec.env import engine_env, vllm_python

ROOT = Path(__file__).resolve().parents[1]


def run_scenarios(script: str, out: Path) -> dict:
    """``python tests/<script> OUT`` in the vLLM environment; its results, with its log."""
    try:
        python = vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (make test builds it)")
    done = subprocess.run(
        [str(python), str(ROOT / "tests" / script), str(out)],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    result["log"] = done.stdout + done.stderr
    return result
