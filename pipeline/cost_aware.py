"""Building the cost-aware policies by name (they need artifacts the simple ones do not)."""

from __future__ import annotations

from typing import Any

from pipeline.ecospec import EcoSpecGlobalPolicy, EcoSpecPolicy
from pipeline.marginal_policy import MarginalPolicy
from pipeline.policies import Policy
from pipeline.policy_artifacts import PolicyArtifacts, load_artifacts

COST_AWARE = {"ecospec": EcoSpecPolicy, "ecospec-global": EcoSpecGlobalPolicy,
              "marginal": MarginalPolicy}  # fmt: skip


def build_cost_aware(name: str, knobs: dict[str, Any], artifacts: PolicyArtifacts | None) -> Policy:
    art = artifacts or load_artifacts()
    knobs = dict(knobs)
    if name == "marginal":
        lam = knobs.pop("lam", art.lam)
        if not isinstance(lam, int | float) or isinstance(lam, bool):
            raise ValueError(f"marginal: lam must be a number, got {lam!r}")
        if "max_k" in knobs and not 1 <= knobs["max_k"] <= art.cost.max_m - 1:
            raise ValueError(f"marginal: max_k must lie in [1, {art.cost.max_m - 1}] (the cost "
                             f"model's largest m - 1), got {knobs['max_k']}")  # fmt: skip
        return MarginalPolicy(art.cost, float(lam), art.predictor, **knobs)
    return COST_AWARE[name](art.predictor, **knobs)
