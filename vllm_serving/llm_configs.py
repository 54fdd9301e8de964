"""The app's settings as ray.serve.llm ``LLMConfig`` objects: one engine deployment per model
id, its ``speculative_config`` built the way jobs.bench_vllm builds it (one code path from a
method name and K to vLLM's config, pipeline.vllm_spec.methods); ``ours`` adds the
cost-aware scheduler (``scheduler_cls``) over vLLM's draft_model drafter, ``ours-eagle3`` over
its EAGLE-3 drafter (the head checked against the target first)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.vllm_spec.methods import Method
from pipeline.vllm_spec.planner_config import PlannerConfig
from vllm_serving.settings import ServedModel, VllmAppArgs

ROOT = Path(__file__).resolve().parents[1]
# By its import path: the replica loads it (that module needs ray.llm, the vLLM environment).
LOCAL_MODEL_FOLDERS = "vllm_serving.local_models.LocalModelFolders"


def resolve(path: str | None, default: str) -> str:
    """An absolute path: replicas run in Ray's session directory, not the repository."""
    p = Path(path or default)
    return str(p if p.is_absolute() else (ROOT / p).resolve())


def engine_env(args: VllmAppArgs) -> dict[str, str]:
    """What every engine replica's processes need: the project on the path (the scheduler and
    the plugin's parts are imported in vLLM's processes), and on CPU the CPU build's settings."""
    env = {"PYTHONPATH": str(ROOT)}
    if not args.on_gpu:
        # nobind: 2 cores leave none to pin; the KV cache must fit beside the models. OpenMP
        # threads: the engine's CPUs, at least one (more threads than its share stall steps
        # while the serving processes run: pipeline.vllm_spec.env.engine_threads).
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(max(1, int(args.engine_cpus)))
    return env


def check_head(head: str, target: str) -> None:
    """Refuse an EAGLE-3 head trained for another target, at deploy: vLLM checks neither the
    verifier nor the feature width (a mismatch fails at the first draft step)."""
    from transformers import AutoConfig

    from pipeline.models.eagle3_formats import read_config
    from pipeline.models.eagle3_verifier import bind_to_target

    bind_to_target(read_config(head)[0], AutoConfig.from_pretrained(target))


def speculation(
    model: ServedModel, target: str, draft: str, head: str = ""
) -> tuple[dict | None, dict[str, Any], dict[str, str]]:
    """(vLLM's speculative_config or None, extra engine arguments, the engine's extra env) of
    one model id. Settings are checked here, at deploy, with their reason: vLLM reports a
    scheduler or drafter that fails to build only as "Engine core initialization failed"."""
    if model.speculation == "none":
        return None, {}, {}
    k = model.draft_length
    if model.speculation in ("eagle3", "ours-eagle3"):
        check_head(head, target)
    knobs: dict[str, Any] = {"k": k}
    if model.draft_sample_method is not None:
        knobs["draft_sample_method"] = model.draft_sample_method
    policy = None
    if model.speculation in ("ours", "ours-eagle3"):
        PlannerConfig(**model.policy)
        policy = model.policy
    entry = Method(model.name, model.speculation, knobs).entry(draft, head, policy)
    return entry["speculative_config"], entry.get("engine_kwargs", {}), entry.get("env", {})


def llm_config_dicts(args: VllmAppArgs) -> list[dict[str, Any]]:
    """One LLMConfig (as a dict) per model id."""
    target = resolve(args.target, "models/target")
    draft = resolve(args.draft, "models/draft")
    head = resolve(args.head, "models/eagle3-head")
    gpu = args.on_gpu
    bundle: dict[str, float] = {"CPU": args.engine_cpus} | ({"GPU": args.num_gpus} if gpu else {})
    configs = []
    for model in args.models:
        dtype = args.dtype if args.dtype != "auto" or gpu else "float32"
        spec, extra, extra_env = speculation(model, target, draft, head)
        engine: dict[str, Any] = {
            "dtype": dtype,
            "enforce_eager": (not gpu) if args.enforce_eager is None else args.enforce_eager,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "disable_log_stats": False,
        }
        if spec is not None:
            engine["speculative_config"] = spec
            # Each response says what speculation did for it: metrics.speculative_decoding
            # (drafted and accepted tokens, accepted length; vLLM reports it when n = 1).
            engine["per_request_spec_decode_metrics"] = "summary"
        engine |= extra
        configs.append(
            {
                "model_loading_config": {"model_id": model.name, "model_source": target},
                "engine_kwargs": engine,
                # Without it ray.serve.llm asks every engine for a GPU; with it the engine's
                # placement group is this bundle (on CPU: vLLM's CPU engine).
                "placement_group_config": {"bundles": [bundle]},
                "runtime_env": {"env_vars": engine_env(args) | extra_env},
                "deployment_config": {
                    # The engine's bundle holds the replica's CPUs; the actor itself asks for
                    # none, so two replicas fit on two cores.
                    "ray_actor_options": {"num_cpus": 0},
                    "max_ongoing_requests": args.max_ongoing_requests,
                    "autoscaling_config": {
                        "min_replicas": args.min_replicas,
                        "max_replicas": args.max_replicas,
                        "target_ongoing_requests": args.target_ongoing_requests,
                        "upscale_delay_s": 2,
                    },
                    "health_check_period_s": 5,
                },
                "log_engine_metrics": True,  # vLLM's counters as Ray metrics (Prometheus)
                "callback_config": {"callback_class": LOCAL_MODEL_FOLDERS},
            }
        )
    return configs


def describe(args: VllmAppArgs) -> str:
    """Each model id's speculation as /healthz and /v1/models state it."""
    out = {}
    for m in args.models:
        out[m.name] = {"speculation": m.speculation, "k": m.draft_length}
        if m.draft_sample_method is not None:
            out[m.name]["draft_sample_method"] = m.draft_sample_method
    return json.dumps(out)
