"""The policy registry is the one source of policy names, labels and knobs: every registered
policy is labelled (default at a temperature, peer with the work it follows, or experimental),
is built from its declared defaults, decodes losslessly at T = 0, and refuses a knob of the
wrong type or out of its declared range with an error naming the knob. A policy added to the
registry is covered here without touching this file."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipeline.acceptance.model import AcceptanceModel, ModeModel
from pipeline.cost.model import CostModel
from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import Knob, KnobError
from pipeline.decode.policies.labels import (
    EXPERIMENTAL,
    KINDS,
    TEMPERATURES,
    PolicyLabel,
    default,
    peer,
)
from pipeline.decode.policies.registry import (
    POLICIES,
    make_policy,
    register_policy,
    validate_knobs,
)
from pipeline.decode.step_limits import StepWork
from pipeline.predictor.model import ExpertMLP, LearnedExpertPredictor
from tests.test_engine import perturbed_pair


@pytest.fixture(scope="module")
def pair():
    return perturbed_pair("qwen3_moe", noise=0.3)


@pytest.fixture(scope="module")
def artifacts(pair) -> PolicyArtifacts:
    return synthetic_artifacts(pair)


def synthetic_artifacts(pair) -> PolicyArtifacts:
    """Artifacts for the cost-aware policies on a test pair: an untrained expert predictor
    (seeded), a made-up cost model, lambda and acceptance model (acceptance rising with the
    draft's confidence; a head that reads the draft's state)."""
    torch.manual_seed(0)
    spec = pair.spec
    predictor = LearnedExpertPredictor(
        ExpertMLP(
            pair.draft.config.vocab_size,
            pair.draft.config.hidden_size,
            spec.num_moe_layers,
            spec.num_experts,
        ),
        spec.top_k,
    )
    cost = CostModel(
        {m: 4 + 0.2 * m for m in range(1, 14)}, {m: 0.3 for m in range(1, 14)}, 0.001, 0.4, 0.1
    )
    hidden = pair.draft.config.hidden_size
    weights = [-2.0, 0.0, 5.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0]  # over FEATURE_NAMES
    mode = ModeModel(weights, weights, 0.5, [0.5] + [0.01] * hidden, [-1.0, 0.0, 1.0])
    acceptance = AcceptanceModel({"greedy": mode, "sampled": mode}, [2.0 + m for m in range(13)])
    return PolicyArtifacts(predictor, cost, 500.0, acceptance)


def wrong_type(knob: Knob):
    """A value of the wrong type for the knob: a float for an int, a string for a float, an
    int for a bool."""
    return {int: 2.5, float: "fast", bool: 1}[knob.type]


def out_of_range(knob: Knob):
    """A value of the right type just outside the declared range (None: unbounded)."""
    if knob.low is not None:
        return knob.type(knob.low) if knob.low_open else knob.type(knob.low) - 1
    if knob.high is not None:
        return knob.type(knob.high) + 1
    return None


ALL_KNOBS = [(name, k) for name, cls in POLICIES.items() for k in cls.knobs]


def test_the_registry_lists_every_policy_once_with_typed_bounded_knobs():
    assert len(POLICIES) == len(set(POLICIES))
    for name, cls in POLICIES.items():
        assert cls.name == name and cls.summary, name
        names = [k.name for k in cls.knobs]
        assert len(names) == len(set(names)), name
        for knob in cls.knobs:
            assert knob.type in (int, float, bool), (name, knob)
            if knob.type is int:  # every integer knob sizes a step: bounded on both sides
                assert knob.low is not None and knob.high is not None, (name, knob)
        if dataclasses.is_dataclass(cls):  # every knob is a constructor field
            fields = {f.name for f in dataclasses.fields(cls)}
            assert set(names) <= fields, (name, set(names) - fields)


# --- labels: what each policy is to the product ------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_has_a_valid_label_of_its_own(name):
    cls = POLICIES[name]
    label = cls.__dict__.get("label")  # declared by the class, not inherited
    assert isinstance(label, PolicyLabel), name
    assert label.kind in KINDS, (name, label)
    if label.kind == "default":
        assert label.temperature in TEMPERATURES, (name, label)
    else:
        assert label.temperature is None, (name, label)
    if label.kind == "peer":
        assert label.follows and label.follows.strip(), (name, "a peer names its paper")
    if label.kind == "experimental":
        assert label.follows is None, name


def test_exactly_one_default_per_temperature_regime():
    defaults: dict[str, list[str]] = {t: [] for t in TEMPERATURES}
    for name, cls in POLICIES.items():
        if cls.label.kind == "default":
            defaults[cls.label.temperature].append(name)
    assert all(len(names) == 1 for names in defaults.values()), defaults


def test_the_default_labels_are_what_a_request_without_a_policy_gets():
    """The labels agree with the endpoint: a request naming no policy gets the T = 0 default
    at temperature 0 and the T > 0 default at its default temperature (1.0), with the
    committed artifacts."""
    from pipeline.decode.policies.artifacts import load_artifacts
    from serving.protocol import CompletionRequest
    from serving.speculation import default_spec

    by_regime = {cls.label.temperature: n for n, cls in POLICIES.items() if cls.label.temperature}
    artifacts = load_artifacts()
    assert default_spec(artifacts, 0.0)[0] == by_regime["T = 0"]
    request_t = CompletionRequest(prompt="x").temperature
    assert request_t == 1.0
    assert default_spec(artifacts, request_t)[0] == by_regime["T > 0"]


def test_the_labels_are_listed_with_the_policies():
    from serving.speculation import policy_labels, policy_names

    labels = policy_labels()
    assert set(labels) == set(policy_names())
    assert labels["throughput"] == {"kind": "default", "temperature": "T = 0"}
    assert labels["fixed"]["kind"] == "peer" and labels["fixed"]["follows"]


def test_a_label_says_what_its_kind_needs():
    assert str(default("T > 0", "SpecDec++")) == "default at T > 0: SpecDec++"
    assert str(EXPERIMENTAL) == "experimental"
    for bad in (
        lambda: PolicyLabel("ours"),
        lambda: PolicyLabel("default"),  # no temperature
        lambda: default("T = 1"),  # not a regime
        lambda: PolicyLabel("peer"),  # no paper
        lambda: peer(""),
        lambda: PolicyLabel("experimental", temperature="T = 0"),
        lambda: PolicyLabel("experimental", follows="a paper"),
    ):
        with pytest.raises(ValueError):
            bad()


def test_registration_without_a_label_fails():
    work = StepWork(draft_forwards=0, draft_tokens=0, verified=1, why="nothing")

    class Unlabelled(Policy):
        name = "unlabelled"
        summary = "test only"

        def step_work(self) -> StepWork:
            return work

    class Inheriting(POLICIES["throughput"]):  # a subclass must say what it is itself
        name = "inheriting"

    for cls in (Unlabelled, Inheriting):
        with pytest.raises(TypeError, match="label"):
            register_policy(cls)
        assert cls.name not in POLICIES


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_builds_from_its_declared_defaults(name, artifacts):
    cls = POLICIES[name]
    defaults = {k.name: k.default for k in cls.knobs if k.default is not None}
    assert validate_knobs(name, defaults) == defaults
    policy = make_policy(name, artifacts, **defaults)
    assert isinstance(policy, cls)
    for key, value in defaults.items():
        assert getattr(policy, key) == value, (name, key)
    built = make_policy(name, artifacts)  # no knobs: the class's own defaults
    for key, value in defaults.items():
        assert getattr(built, key) == value, (name, key, "declared default differs")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_direct_construction_is_checked_like_make_policy(name, artifacts):
    cls = POLICIES[name]
    for knob in cls.knobs:
        bad = out_of_range(knob)
        if bad is None or not dataclasses.is_dataclass(cls) or cls.needs_artifacts:
            continue
        with pytest.raises(KnobError, match=knob.title or knob.name):
            cls(**{knob.name: bad})


def test_an_integer_beyond_float_range_is_not_finite():
    with pytest.raises(KnobError, match="must be finite"):
        validate_knobs("confidence", {"threshold": 10**400})


@pytest.mark.parametrize(("name", "knob"), ALL_KNOBS, ids=[f"{n}.{k.name}" for n, k in ALL_KNOBS])
def test_a_knob_of_the_wrong_type_or_out_of_range_is_refused_by_name(name, knob, artifacts):
    with pytest.raises(KnobError, match=f"'{knob.name}'") as wrong:
        make_policy(name, artifacts, **{knob.name: wrong_type(knob)})
    assert wrong.value.knob == knob.name
    bad = out_of_range(knob)
    if bad is None:
        return
    with pytest.raises(KnobError, match=knob.title or knob.name) as outside:
        make_policy(name, artifacts, **{knob.name: bad})
    assert outside.value.knob == knob.name


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_unknown_knob_is_refused_with_the_policy_s_knobs(name):
    with pytest.raises(KnobError, match=f"unknown knob 'colour'.*{name!r}|{name!r}.*'colour'"):
        validate_knobs(name, {"colour": 3})


def test_ints_are_taken_for_floats_but_not_bools_for_ints():
    assert validate_knobs("confidence", {"threshold": 1}) == {"threshold": 1.0}
    with pytest.raises(KnobError, match="must be an integer, got bool"):
        validate_knobs("fixed", {"k": True})


# Knob settings beyond the declared defaults, checked on every configuration below (the
# per-policy greedy tests that had them are folded in here): a shorter chain, an early exit
# that fires often, a smaller tree, a smaller tree budget, a chain capped below the default.
KNOB_CASES = [
    ("fixed", {"k": 3}),
    ("confidence", {"threshold": 0.3, "max_k": 6}),
    ("tree", {"depth": 3, "branch": 2, "gamma": 7}),
    ("ecospec", {"gamma": 4}),
    ("marginal", {"max_k": 8}),
]


def _tiny(family: str):
    pair = perturbed_pair(family, noise=0.3)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, size=int(rng.integers(2, 9))).tolist() for _ in range(8)]
    return pair, synthetic_artifacts(pair), prompts, 16


def _embedded():
    from pipeline.data.prompts import load_humaneval
    from pipeline.decode.policies.artifacts import load_artifacts
    from pipeline.models.loading import load_pair

    pair = load_pair()
    texts = ["def fib(n):\n    if n < 2:\n", *(p.text for p in load_humaneval(limit=2))]
    prompts = [pair.tokenizer(t, add_special_tokens=False)["input_ids"][-256:] for t in texts]
    return pair, load_artifacts(), prompts, 24


def _embedded_head():
    """The embedded target with its committed EAGLE-3 head (synthetic artifacts: the
    committed ones were learned with the draft model)."""
    from pipeline.data.prompts import load_humaneval
    from pipeline.models.loading import DEFAULT_HEAD, load_pair

    pair = load_pair(draft=DEFAULT_HEAD)
    texts = ["def fib(n):\n    if n < 2:\n", *(p.text for p in load_humaneval(limit=2))]
    prompts = [pair.tokenizer(t, add_special_tokens=False)["input_ids"][-256:] for t in texts]
    return pair, synthetic_artifacts(pair), prompts, 24


CONFIGURATIONS = {
    # Tiny noisy pairs of two MoE families, synthetic artifacts: 8 random prompts, 16 tokens.
    "qwen3_moe": lambda: _tiny("qwen3_moe"),
    "mixtral": lambda: _tiny("mixtral"),
    # The embedded models with the artifacts committed beside them: code prompts, 24 tokens.
    "embedded": _embedded,
    # The embedded target drafting with its EAGLE-3 head (pipeline.decode.head_drafter).
    "embedded-eagle3": _embedded_head,
}


@pytest.mark.usefixtures("one_torch_thread")  # many tiny forwards
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_every_registered_policy_is_lossless_at_temperature_zero(configuration):
    """Every registered policy at its declared defaults, and the KNOB_CASES, decodes exactly
    plain greedy decoding's tokens (a direct cached loop over the target, no engine), on every
    prompt; and speculation was really exercised: every policy but `ar` gets draft tokens
    accepted over the prompts."""
    pair, artifacts, prompts, n = CONFIGURATIONS[configuration]()
    engine = SpeculativeEngine(pair)
    cases = [(name, {}) for name in POLICIES] + KNOB_CASES
    accepted = [0] * len(cases)
    for prompt in prompts:
        expected = greedy_continuation(pair.target, prompt, n, eos_id=None)
        for i, (name, knobs) in enumerate(cases):
            policy = make_policy(name, artifacts, **knobs)
            gen = engine.generate(prompt, policy, n, stop_at_eos=False)
            assert gen.tokens == expected, (configuration, name, knobs, prompt)
            accepted[i] += sum(s.accepted for s in gen.steps)
    idle = [c for c, a in zip(cases, accepted, strict=True) if a == 0 and c[0] != "ar"]
    assert not idle, (configuration, idle)
