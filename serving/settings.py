"""The deployment's settings: `serve run serving.app:build_app key=value ...` or `args:` in a
Serve config file, validated (and converted from strings) here."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.decode.step_limits import StepLimits


class AppArgs(BaseModel):
    """`serve run serving.app:build_app key=value ...` (or `args:` in a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = None  # None: the embedded models, resolved on the replica's node
    draft: str | None = None
    # The cost-aware policies' artifacts (costmodel.json, acceptance.json, ...): None reads
    # them beside the draft when it holds its own (models/eagle3-head), else models/'s.
    artifacts: str | None = None
    device: str = "auto"  # CUDA when the replica has a GPU
    dtype: str = "auto"
    experts_implementation: str = "eager"  # the MoE kernel; the cost model records its own
    model_name: str = "specbound"  # the id in /v1/models and responses
    max_tokens_limit: int = Field(1024, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_choices: int = Field(16, ge=1)  # generations per request: prompts x n
    num_cpus: float = Field(1.0, ge=0)  # <= 1 on small machines: the proxy needs a core
    num_gpus: float | None = Field(None, ge=0)  # None: 1 if this machine has CUDA, else 0
    max_ongoing_requests: int = Field(8, ge=1)
    # Generations the replica advances together in one batched engine step (continuous
    # batching); 1 decodes them one at a time, round robin.
    max_batch: int = Field(16, ge=1)
    # ... and at most this many positions verified per step over the seated generations (their
    # policies' declared step work; one generation alone always runs), so one step of the
    # batch costs about what the heaviest request alone would.
    max_batch_positions: int = Field(256, ge=1)
    # Work of one engine step, jointly over a policy's knobs (pipeline.decode.step_limits).
    max_draft_forwards_per_step: int = Field(StepLimits.max_draft_forwards, ge=1)
    max_draft_tokens_per_step: int = Field(StepLimits.max_draft_tokens, ge=1)
    max_verified_per_step: int = Field(StepLimits.max_verified, ge=2)
    max_tree_nodes_per_step: int = Field(StepLimits.max_tree_nodes, ge=1)
    # A request's generations end ("deadline") this long after it arrived; a request may ask
    # for less with `timeout_s`.
    request_timeout_s: float = Field(60.0, gt=0)
    # One step running longer than this fails the health check: Serve replaces the replica.
    stall_timeout_s: float = Field(60.0, gt=0)
    # On shutdown, generations still running after Serve's drain are cancelled and the
    # decoding thread gets this long to let them end.
    shutdown_timeout_s: float = Field(10.0, ge=0)
    # Set: every /v1 route needs `Authorization: Bearer <api_key>` (/healthz stays open).
    api_key: str | None = None
    # Modules imported at replica start, e.g. to register more policies.
    policy_modules: list[str] = []
    # The committed cost model was measured on one device/dtype/experts implementation and
    # checkpoint pair; cost-aware policies refuse other settings unless this is set.
    allow_costmodel_mismatch: bool = False

    def step_limits(self) -> StepLimits:
        return StepLimits(
            self.max_draft_forwards_per_step,
            self.max_draft_tokens_per_step,
            self.max_verified_per_step,
            self.max_tree_nodes_per_step,
        )
