"""The Ray Serve application over vLLM: ray.serve.llm engine replicas (vLLM's async engine,
one per replica, its speculation fixed at start) behind an OpenAI-compatible ingress.

    serve run vllm_serving.app:build_app                         # embedded models, ours, CPU
    serve run vllm_serving.app:build_app speculation=draft_model k=2
    serve run vllm_serving.app:build_app speculation=none
    serve run vllm_serve_config.yaml                             # three settings side by side

Runs in the vLLM environment (`make vllm-env`: vLLM, Ray Serve, the project on PYTHONPATH).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.serve import Application
from ray.serve.llm import LLMConfig, build_llm_deployment
from ray.serve.llm.ingress import make_fastapi_ingress

from vllm_serving.ingress import ENDPOINTS, SpecboundIngress, router_app
from vllm_serving.llm_configs import describe, llm_config_dicts
from vllm_serving.placement import check_placement
from vllm_serving.settings import VllmAppArgs

log = logging.getLogger("ray.serve")

INGRESS_NAME = "SpecboundVllmIngress"


def build_app(cli_args: dict[str, Any] | None = None) -> Application:
    """The app from `serve run` key=value arguments or a config file's `args:`; bad settings
    are refused here, before any replica starts, with their reason, and so is an app whose
    engine replicas the connected cluster cannot hold (vllm_serving.placement.check_placement)."""
    args = VllmAppArgs.model_validate(cli_args or {})
    config_dicts = llm_config_dicts(args)
    check_placement(config_dicts)
    configs = [LLMConfig(**c) for c in config_dicts]
    log.info("specbound on vLLM: %s", describe(args))
    ingress = make_fastapi_ingress(SpecboundIngress, endpoint_map=ENDPOINTS, app=router_app())
    deployment = serve.deployment(
        ingress,
        name=INGRESS_NAME,
        num_replicas=1,
        # Requests wait here for an engine replica's slot (each has max_ongoing_requests),
        # inside their deadline; the ingress itself only relays.
        max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=5,
    )
    return deployment.bind(
        llm_deployments={c.model_id: build_llm_deployment(c) for c in configs},
        model_cards={c.model_id: to_model_metadata(c.model_id, c) for c in configs},
        request_timeout_s=args.request_timeout_s,
        api_key=args.api_key,
        speculation=json.loads(describe(args)),
    )
