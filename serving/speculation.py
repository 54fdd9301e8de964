"""The request's ``speculation`` field: which policy, with which knobs. Knob names, types and
ranges come from the policy registry (pipeline.decode.policies.registry), so every registered
policy is validated the same way: a wrong type or a value out of range is a 400 naming the
field, never a failure mid-generation."""

from __future__ import annotations

import logging
from typing import Any

from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import MAX_STEP_KNOB, describe
from pipeline.decode.policies.registry import POLICIES, make_policy, validate_knobs
from serving.errors import RequestError

log = logging.getLogger("ray.serve")

# The default is chosen per request's temperature (docs/online.md, "The default per
# temperature"), from the domain benchmark on the served pair. T = 0: `throughput`, 1.19-1.22x
# the best fixed K where `specdec` reaches 1.06-1.08x. T > 0: `specdec`, 6-8% ahead of
# `throughput` in each of four interleaved runs at T = 1 (0.97-1.03x the best fixed K against
# 0.91-0.97x): there chains gain little over a fixed K, and `throughput`'s per-token decisions
# cost more than they find. Both read the committed models/acceptance.json.
DEFAULT_POLICY = "throughput"
DEFAULT_KNOBS: dict[str, Any] = {}
SAMPLED_DEFAULT_POLICY = "specdec"
# The default where the artifacts (acceptance.json) did not load: a request without a
# `speculation` field is still served, by the previous default.
FALLBACK_POLICY = "fixed"
FALLBACK_KNOBS: dict[str, Any] = {"k": 4}


def default_spec(
    artifacts: PolicyArtifacts | None, temperature: float = 0.0
) -> tuple[str, dict[str, Any]]:
    """The policy of a request that names none, for its ``temperature``: the default when this
    server has what it needs, else the fallback (never a 500 for a request that asked for
    nothing). `specdec` needs the acceptance model's head; without one T > 0 keeps
    `throughput`."""
    if artifacts is None or artifacts.acceptance is None:
        return FALLBACK_POLICY, dict(FALLBACK_KNOBS)
    sampled = artifacts.acceptance.modes.get("sampled")
    if temperature > 0 and sampled is not None and sampled.head:
        return SAMPLED_DEFAULT_POLICY, {}
    return DEFAULT_POLICY, dict(DEFAULT_KNOBS)


# make_policy(name, [artifacts,] **knobs): a knob with one of these names would bind to
# make_policy's own parameters, not reach the policy.
_RESERVED = frozenset({"name", "artifacts"})


def build_policy(
    name: str,
    knobs: dict[str, Any],
    artifacts: PolicyArtifacts | None = None,
    unavailable: str | None = None,
) -> Policy:
    """The policy for a request. Types and the upper bounds are checked here with the knob's
    own field as ``param``; make_policy then checks names and ranges, and its ValueError
    becomes a 400 too. ``artifacts`` (checked against the served pair at startup) serve the
    cost-aware policies; ``unavailable`` says why there are none (a server fault: 500)."""
    declared = {k.name: k for k in POLICIES[name].knobs} if name in POLICIES else {}
    for key, value in knobs.items():
        param = f"speculation.{key}"
        if not isinstance(value, bool | int | float | str):
            raise RequestError(
                f"knob '{key}' must be a number, string or boolean, got {describe(value)}", param
            )
        spec = declared.get(key)
        if spec is None:
            continue  # unknown: make_policy names it with the policy's knobs
        problem = spec.type_error(value)
        if problem:
            raise RequestError(problem, param)
        if spec.type is not bool and spec.high is not None and value > spec.high:
            why = (
                " (one step would draft or verify too many tokens)"
                if (spec.type is int and spec.high == MAX_STEP_KNOB)
                else ""
            )
            raise RequestError(
                f"knob '{key}' = {value} is too large: it must be <= {spec.high:g}{why}", param
            )
    reserved = [k for k in knobs if k in _RESERVED]
    if reserved:
        raise RequestError(f"unknown knob '{reserved[0]}'", f"speculation.{reserved[0]}")
    try:
        validate_knobs(name, knobs)  # a bad request is a 400 even where the policy is down
    except ValueError as exc:
        raise RequestError(str(exc), "speculation") from None
    if POLICIES[name].needs_artifacts and artifacts is None and unavailable:
        raise RequestError(
            f"policy '{name}' is unavailable on this server: {unavailable}",
            "speculation",
            status=500,
            kind="server_error",
        )
    try:
        return make_policy(name, artifacts, **knobs)
    except ValueError as exc:
        raise RequestError(str(exc), "speculation") from None
    except Exception as exc:  # e.g. a cost-aware policy's artifacts missing on this server
        log.warning("cannot build policy %r: %s: %s", name, type(exc).__name__, exc)
        raise RequestError(
            f"policy '{name}' is unavailable on this server: {type(exc).__name__}: {exc}",
            "speculation",
            status=500,
            kind="server_error",
        ) from None


def policy_names() -> list[str]:
    return list(POLICIES)  # plugins registered at replica start included


def policy_labels() -> dict[str, dict[str, str]]:
    """Each policy's label as /v1/models lists it: kind (default, peer, experimental), the
    temperature regime a default serves, the work a peer follows."""
    return {name: cls.label.as_dict() for name, cls in POLICIES.items() if cls.label}
