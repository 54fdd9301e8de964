"""The vLLM app's settings: `serve run vllm_serving.app:build_app key=value ...` or `args:` in a
Serve config file (vllm_serve_config.yaml), validated (and converted from strings) here.

A replica runs one vLLM engine with one speculation setting: vLLM fixes the method and the
longest draft when the engine starts and takes no per-request choice of either. An app may
serve several settings side by side, each under its own model id (`models`), and a request
chooses one with its `model` field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.vllm_spec.methods import DRAFT_SAMPLE_METHODS, METHOD_KNOBS

# ours: vLLM's draft_model drafter, the draft length of every step chosen by the cost-aware
# scheduler (pipeline.vllm_spec.scheduler); draft_model and ngram: vLLM's own at a fixed K;
# eagle3: vLLM's EAGLE-3 drafter over the head at a fixed K; ours-eagle3: that drafter under
# the cost-aware scheduler; none: no speculation.
SPECULATION = ("ours", "ours-eagle3", "draft_model", "eagle3", "ngram", "none")
DEFAULT_K = {
    "ours": 4,
    "ours-eagle3": 4,
    "draft_model": 2,
    "eagle3": 4,
    "ngram": 4,
    "none": 0,
}
POLICY_SETTINGS = ("ours", "ours-eagle3")
# The settings that take draft_sample_method (vLLM's draft_model drafts greedily by default,
# ours probabilistically).
SAMPLED_DRAFTING = tuple(m for m, knobs in METHOD_KNOBS.items() if "draft_sample_method" in knobs)


class ServedModel(BaseModel):
    """One model id of the app: the target with one speculation setting."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("specbound", min_length=1, pattern=r"^[A-Za-z0-9._:-]+$")
    speculation: str = "ours"  # of SPECULATION
    k: int | None = Field(None, ge=1, le=16)  # the longest draft; None: DEFAULT_K
    # The cost-aware scheduler's settings (ours, ours-eagle3):
    # pipeline.vllm_spec.planner_config.PlannerConfig's fields (SPECBOUND_SCHEDULER).
    policy: dict[str, Any] = {}
    # How the draft model drafts at T > 0 (ours and draft_model): None is the method's default.
    draft_sample_method: str | None = None

    @field_validator("speculation")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in SPECULATION:
            raise ValueError(f"speculation {value!r}: one of {', '.join(SPECULATION)}")
        return value

    @field_validator("draft_sample_method")
    @classmethod
    def _sample_method(cls, value: str | None) -> str | None:
        if value is not None and value not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"draft_sample_method {value!r}: one of {', '.join(DRAFT_SAMPLE_METHODS)}"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ServedModel:
        if self.speculation == "none" and self.k is not None:
            raise ValueError(f"model {self.name!r}: speculation none takes no k")
        if self.policy and self.speculation not in POLICY_SETTINGS:
            raise ValueError(
                f"model {self.name!r}: policy settings are for speculation "
                f"{', '.join(POLICY_SETTINGS)}"
            )
        if self.draft_sample_method is not None and self.speculation not in SAMPLED_DRAFTING:
            raise ValueError(
                f"model {self.name!r}: draft_sample_method is for speculation "
                f"{', '.join(SAMPLED_DRAFTING)}"
            )
        return self

    @property
    def draft_length(self) -> int:
        return self.k if self.k is not None else DEFAULT_K[self.speculation]


class VllmAppArgs(BaseModel):
    """`serve run vllm_serving.app:build_app key=value ...` (or `args:` in a config file)."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = None  # None: the embedded models/target (absolute paths elsewhere)
    draft: str | None = None  # the draft of draft_model and of ours; None: models/draft
    head: str | None = None  # the EAGLE-3 head of eagle3 and ours-eagle3; None: models/eagle3-head
    # One engine deployment per entry; a bare `speculation=` / `k=` sets the single model's.
    models: list[ServedModel] = [ServedModel()]
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$")  # auto: CUDA when num_gpus > 0
    dtype: str = "auto"  # auto: float32 on CPU (vLLM's CPU build), the checkpoint's on CUDA
    num_gpus: float = Field(0.0, ge=0)  # per engine replica; 0: vLLM's CPU engine
    engine_cpus: float = Field(1.0, gt=0)  # per engine replica (its placement group bundle)
    kv_cache_gib: float = Field(2.0, gt=0)  # CPU engines: VLLM_CPU_KVCACHE_SPACE
    max_model_len: int = Field(1024, ge=16)
    max_num_seqs: int = Field(16, ge=1)  # sequences one engine step may hold
    enforce_eager: bool | None = None  # None: on CPU (the CPU build's tested path), off on CUDA
    # Serve: replicas per model (autoscaling between min and max by ongoing requests).
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: int = Field(8, ge=1)
    max_ongoing_requests: int = Field(32, ge=1)  # per replica; more wait at the ingress
    # A request's stream ends with finish_reason "deadline" this long after it arrived (a
    # whole response: 504); vLLM stops generating for it.
    request_timeout_s: float = Field(60.0, gt=0)
    # Set: every route but /healthz needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`speculation=`, `k=`, `policy=` and `draft_sample_method=` at the top level set the one
        model's; strings from the command line (`models=[...]`, `policy={...}`) are JSON."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in ("models", "policy"):
            if isinstance(data.get(key), str):
                try:
                    data[key] = json.loads(data[key])
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{key}: not JSON: {exc}") from exc
        shorthand = ("speculation", "k", "policy", "draft_sample_method", "model_name")
        single = {k: data.pop(k) for k in shorthand if k in data}
        if single:
            if "models" in data:
                raise ValueError(
                    "give either models=[...] or speculation/k/policy/draft_sample_method, not both"
                )
            if "model_name" in single:
                single["name"] = single.pop("model_name")
            data["models"] = [single]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> VllmAppArgs:
        names = [m.name for m in self.models]
        if not names:
            raise ValueError("models: at least one")
        if len(set(names)) < len(names):
            raise ValueError(f"models: names must differ, got {names}")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.device == "cuda" and self.num_gpus == 0:
            raise ValueError("device cuda needs num_gpus > 0 (a GPU per engine replica)")
        if self.device == "cpu" and self.num_gpus > 0:
            raise ValueError("device cpu takes num_gpus 0")
        if self.api_key is not None:
            from serving.auth import check_api_key

            check_api_key(self.api_key)
        return self

    @property
    def on_gpu(self) -> bool:
        return self.num_gpus > 0
