"""Every draft policy, registered once by name with its knobs (types, ranges, defaults), and
the one way to build one: ``make_policy(name, [artifacts,] **knobs)``.

Tests iterate over ``POLICIES`` (losslessness, knob validation, the endpoint's 400s, labels),
so a policy added here is covered the day it is added. Every policy declares its label
(default at a temperature, peer with the work it follows, or experimental); registration
refuses one without. The knobs live beside each policy class (``Policy.knobs``); the
cost-aware ones (``needs_artifacts``) are built from the expert predictor, cost model and
lambda committed under models/ unless artifacts are passed.
"""

from __future__ import annotations

from typing import Any

from pipeline.decode.policies.adaedl import AdaEDLPolicy
from pipeline.decode.policies.artifacts import PolicyArtifacts, load_artifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.batch import BatchPolicy
from pipeline.decode.policies.cascade import CascadePolicy
from pipeline.decode.policies.chain_or_tree import ChainOrTreePolicy
from pipeline.decode.policies.ecospec import EcoSpecGlobalPolicy, EcoSpecPolicy
from pipeline.decode.policies.knobs import KnobError
from pipeline.decode.policies.labels import PolicyLabel
from pipeline.decode.policies.marginal import MarginalPolicy
from pipeline.decode.policies.simple import (
    AutoregressivePolicy,
    ConfidencePolicy,
    FixedPolicy,
    HeuristicPolicy,
)
from pipeline.decode.policies.specdec import SpecDecPolicy
from pipeline.decode.policies.throughput import ThroughputPolicy
from pipeline.decode.policies.tree import TreePolicy


def check_policy_class(cls: type[Policy]) -> type[Policy]:
    """A class fit to register: it declares its own label (default, peer or experimental; a
    subclass does not inherit its parent's) and its step work."""
    label = cls.__dict__.get("label")
    if not isinstance(label, PolicyLabel):
        raise TypeError(
            f"policy {cls.name!r} must declare its own label: default(temperature), "
            "peer(follows) or EXPERIMENTAL (pipeline.decode.policies.labels)"
        )
    if cls.step_work is Policy.step_work:
        raise TypeError(f"policy {cls.name!r} must declare step_work() (its work per step)")
    return cls


POLICIES: dict[str, type[Policy]] = {
    cls.name: check_policy_class(cls)
    for cls in (
        AutoregressivePolicy,
        FixedPolicy,
        HeuristicPolicy,
        ConfidencePolicy,
        TreePolicy,
        EcoSpecPolicy,
        EcoSpecGlobalPolicy,
        MarginalPolicy,
        CascadePolicy,
        AdaEDLPolicy,
        SpecDecPolicy,
        ThroughputPolicy,
        ChainOrTreePolicy,
        BatchPolicy,
    )
}
POLICY_NAMES = tuple(POLICIES)  # the built-in ones; register_policy adds to POLICIES


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Add a policy class (a plugin, e.g. one a serving deployment imports through its
    `policy_modules`) under its ``name``; it must declare its label and its step work.
    Usable as a decorator."""
    if cls.name in POLICIES and POLICIES[cls.name] is not cls:
        raise ValueError(f"a policy named {cls.name!r} is already registered")
    POLICIES[cls.name] = check_policy_class(cls)
    return cls


def policy_class(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise KnobError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


def validate_knobs(name: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs checked against the registry (names, types, ranges) and converted (an int
    where a float is due becomes a float); a KnobError (a ValueError) names the first bad one.
    A knob left out takes the policy's default."""
    cls = policy_class(name)
    declared = {k.name: k for k in cls.knobs}
    out: dict[str, Any] = {}
    for key, value in knobs.items():
        spec = declared.get(key)
        if spec is None:
            choices = ", ".join(declared) or "none"
            raise KnobError(
                f"bad knobs for policy {name!r}: unknown knob {key!r} (its knobs: {choices})"
            )
        if value is None and spec.default is None:
            continue  # "use the artifacts' value", said explicitly
        problem = spec.type_error(value)
        if problem is None:
            problem = spec.range_error(value)
            if problem is not None:
                problem = f"{name}: {problem}"
        else:
            problem = f"bad knobs for policy {name!r}: {problem}"
        if problem:
            raise KnobError(problem, key)
        out[key] = spec.convert(value)
    return out


def make_policy(name: str, artifacts: PolicyArtifacts | None = None, /, **knobs: Any) -> Policy:
    """A policy by name with its knobs; an unknown name, an unknown knob or a value of the
    wrong type or out of range raises a ValueError that names it. ``artifacts`` serve the
    cost-aware policies; by default they are loaded from beside the embedded models."""
    cls = policy_class(name)
    checked = validate_knobs(name, knobs)
    if cls.needs_artifacts:
        artifacts = artifacts or load_artifacts()
    return cls.from_knobs(artifacts, **checked)
