"""The vLLM app's health (vllm_serving.health): each model id's state from Serve's status, the
503 for a model without a running replica, /healthz, and the builder's placement check; then
one real Serve cluster (tests/vllm_health_scenarios.py): a config with one engine too many
refused at build, and an app with a model that cannot be placed answering for it at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
from ray.serve.schema import DeploymentStatusOverview

from vllm_serving.health import (
    FAILED,
    NOT_PLACEABLE,
    RUNNING,
    STARTING,
    UNAVAILABLE,
    UNKNOWN,
    ModelHealth,
    ModelState,
    classify,
)
from vllm_serving.llm_configs import llm_config_dicts
from vllm_serving.placement import (
    Capacity,
    capacity_of,
    check_placement,
    cluster_capacity,
    engine_demand,
    placement_problem,
    shortfall,
)
from vllm_serving.settings import VllmAppArgs

ROOT = Path(__file__).resolve().parents[1]


def _overview(status="UPDATING", message="", **replicas) -> DeploymentStatusOverview:
    return DeploymentStatusOverview(
        status=DeploymentStatus(status),
        status_trigger=DeploymentStatusTrigger.UNSPECIFIED,
        replica_states={ReplicaState(k): v for k, v in replicas.items()},
        message=message,
    )


# -- a model id's state from Serve's status -------------------------------------------------


def test_running_replicas_are_counted_whatever_else_is_going_on():
    state = classify(_overview("UPSCALING", RUNNING=2, STARTING=1), [{"CPU": 1.0}])
    assert state == ModelState(RUNNING, 2, None)


def test_a_pending_placement_group_is_not_placeable_with_needs_and_free():
    state = classify(
        _overview(STARTING=2),
        [{"CPU": 1.0}, {"CPU": 1.0}],
        available={"CPU": 0.0, "memory": 1e9},
        total={"CPU": 1.0, "node:127.0.0.1": 1.0},
    )
    assert (state.state, state.running_replicas) == (NOT_PLACEABLE, 0)
    assert state.reason == (
        "2 engine replicas cannot be placed now: each needs CPU 1, the cluster has CPU 0 free of "
        "CPU 1"
    )


def test_placed_replicas_coming_up_are_starting_with_serves_message():
    slow = "Deployment 'LLMServer:a' has 1 replicas that have taken more than 30s to initialize."
    state = classify(_overview(message=slow, STARTING=1))
    assert state.state == STARTING
    assert state.reason == f"1 engine replica starting (Serve: {slow})"
    assert classify(_overview(RECOVERING=1)).state == STARTING


@pytest.mark.parametrize("status", ["DEPLOY_FAILED", "UNHEALTHY"])
def test_a_failed_deployment_says_what_serve_says(status):
    message = (
        "The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
        '  File "x.py", line 1\nRuntimeError: Engine core initialization failed'
    )
    state = classify(_overview(status, message, STARTING=1), [{"CPU": 1.0}])
    assert state.state == FAILED
    assert state.reason == (
        f"Serve reports {status}: The deployment failed to start 3 times in a row. ... "
        "RuntimeError: Engine core initialization failed"
    )


def test_no_replica_or_no_deployment_is_unavailable():
    assert classify(_overview(STOPPING=1)).state == UNAVAILABLE
    assert classify(None).state == UNAVAILABLE


# -- /healthz, /v1/models and the 503 -------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Reads:
    """A fake of read_serve: hands out the states it is given, counting its calls."""

    def __init__(self, states: dict[str, ModelState]):
        self.states, self.calls = states, 0

    def __call__(self) -> dict[str, ModelState]:
        self.calls += 1
        return dict(self.states)


UP = ModelState(RUNNING, 1)
UNPLACED = ModelState(NOT_PLACEABLE, 0, "1 engine replica cannot be placed now: each needs CPU 1")
SPECULATION = {"a": {"speculation": "ours", "k": 4}, "b": {"speculation": "none", "k": 0}}


def _health(states: dict[str, ModelState], **kw) -> tuple[ModelHealth, Reads, Clock]:
    reads, clock = Reads(states), Clock()
    return ModelHealth(list(states), reads, clock=clock, **kw), reads, clock


def _json(response) -> dict:
    return json.loads(response.body)


async def _refuse(health: ModelHealth, model):
    start = time.monotonic()
    return await health.refusal(model), time.monotonic() - start


def test_healthz_is_ok_only_when_every_model_runs():
    health, _, _ = _health({"a": UP, "b": ModelState(RUNNING, 2)})
    r = asyncio.run(health.healthz(SPECULATION))
    assert r.status_code == 200
    assert _json(r) == {
        "status": "ok",
        "models": {
            "a": {"speculation": "ours", "k": 4, "state": RUNNING, "running_replicas": 1,
                  "reason": None},
            "b": {"speculation": "none", "k": 0, "state": RUNNING, "running_replicas": 2,
                  "reason": None},
        },
    }  # fmt: skip

    health, _, _ = _health({"a": UP, "b": UNPLACED})
    r = asyncio.run(health.healthz(SPECULATION))
    assert r.status_code == 503
    body = _json(r)
    assert body["status"] == "degraded"
    assert body["models"]["a"]["state"] == RUNNING
    assert body["models"]["b"] == {"speculation": "none", "k": 0, **UNPLACED.as_dict()}


def test_a_model_without_a_running_replica_gets_a_prompt_503_in_openais_shape():
    health, _, _ = _health({"a": UP, "b": UNPLACED})

    refused, took = asyncio.run(_refuse(health, "b"))
    assert took < 1.0
    assert refused.status_code == 503
    assert _json(refused) == {
        "error": {
            "message": f"model 'b' has no running replica (not_placeable): {UNPLACED.reason}",
            "type": "server_error",
            "param": "model",
            "code": "model_not_placeable",
        }
    }
    # Served: a running model; left to the router: an unknown model, no model among two.
    assert [asyncio.run(health.refusal(m)) for m in ("a", "nope", None)] == [None, None, None]
    # With one model id, a request naming none is for it.
    alone, _, _ = _health({"b": ModelState(STARTING, 0, "1 engine replica starting")})
    refused, _ = asyncio.run(_refuse(alone, None))
    assert _json(refused)["error"]["code"] == "model_starting"
    assert refused.headers["retry-after"] == "10"


def test_reads_are_shared_and_a_refusal_rests_on_a_fresh_read():
    health, reads, clock = _health({"a": UP, "b": UNPLACED})

    async def scenario():
        await health.states()
        await asyncio.gather(*(health.refusal("a") for _ in range(10)))
        assert reads.calls == 1  # within the TTL every request uses the same read
        clock.now += 0.5
        reads.states["b"] = UP  # b came up since the last read
        assert await health.refusal("b") is None  # re-read before refusing
        assert reads.calls == 2
        clock.now += 10
        reads.states["b"] = UNPLACED
        assert (await health.refusal("b")).status_code == 503

    asyncio.run(scenario())


def test_an_unreadable_status_refuses_nothing_and_says_unknown():
    def broken():
        raise ConnectionError("controller gone")

    health = ModelHealth(["a"], broken)
    assert asyncio.run(health.refusal("a")) is None
    r = asyncio.run(health.healthz({}))
    assert r.status_code == 503
    body = _json(r)
    assert body["status"] == "unknown"
    assert body["models"]["a"]["state"] == UNKNOWN
    assert "controller gone" in body["models"]["a"]["reason"]


def test_a_slow_status_read_never_holds_a_request_past_its_timeout():
    release = threading.Event()

    def slow():
        release.wait(5)
        return {"a": UNPLACED}

    health = ModelHealth(["a"], slow, timeout_s=0.2)

    async def scenario():
        refused, took = await _refuse(health, "a")
        assert refused is None and took < 0.5  # no read yet: unknown, passed on
        release.set()
        await asyncio.sleep(0.2)  # the read in flight lands for the next request
        refused, took = await _refuse(health, "a")
        assert refused.status_code == 503 and took < 0.5

    asyncio.run(scenario())


class Card(BaseModel):
    id: str
    metadata: dict


def test_model_cards_carry_the_state():
    health, _, _ = _health({"a": UP, "b": UNPLACED})
    card = asyncio.run(health.card(Card(id="b", metadata={"limits": {"max_tokens": 8}})))
    assert card.metadata == {"limits": {"max_tokens": 8}, "serving": UNPLACED.as_dict()}
    assert asyncio.run(health.card(None)) is None


# -- the builder's placement check ----------------------------------------------------------


def _configs(n_models: int, **settings) -> list[dict]:
    models = [{"name": f"m{i}", "speculation": "none"} for i in range(n_models)]
    return llm_config_dicts(VllmAppArgs.model_validate({"models": models, **settings}))


def _cluster(cpus: float, *nodes: dict, gpus: float = 0.0) -> Capacity:
    total = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    return Capacity(total, list(nodes) or [total], "its resources now")


def test_one_engine_too_many_is_refused_with_the_shortfall():
    problem = placement_problem(_configs(3), _cluster(2))
    assert problem.startswith(
        "the engine replicas need CPU 3, the cluster has CPU 2 (its resources now). "
        "Engine bundles at min_replicas: m0: 1 x CPU 1; m1: 1 x CPU 1; m2: 1 x CPU 1."
    )
    assert placement_problem(_configs(2), _cluster(2)) is None
    assert "need CPU 4, the cluster has CPU 3" in placement_problem(
        _configs(2, min_replicas=2, max_replicas=2), _cluster(3)
    )
    with pytest.raises(RuntimeError, match=r"cannot place its engine replicas: .* need CPU 3"):
        check_placement(_configs(3), _cluster(2))
    check_placement(_configs(2), _cluster(2))


def test_gpus_and_bundles_no_node_holds():
    gpu = _configs(1, num_gpus=1, device="cuda")
    assert "need GPU 1, the cluster has GPU 0" in placement_problem(gpu, _cluster(8))
    assert placement_problem(gpu, _cluster(8, gpus=1)) is None
    # Two CPUs in all, one on each node: a 2-CPU bundle fits on neither.
    two = _configs(1, engine_cpus=2)
    problem = placement_problem(two, _cluster(2, {"CPU": 1.0}, {"CPU": 1.0}))
    assert problem.startswith("no node can hold one engine's bundle (m0's CPU 2)")


def test_the_builder_agrees_with_vllm_serving_run():
    for n, cpus in [(1, 1), (2, 1), (2, 2), (3, 2), (4, 8)]:
        configs = _configs(n)
        assert (placement_problem(configs, _cluster(cpus)) is None) == (
            shortfall(engine_demand(configs), {"CPU": float(cpus)}) is None
        )


def test_the_shipped_config_fits_two_cpus():
    config = yaml.safe_load((ROOT / "vllm_serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "vllm_serving.app:build_app"
    configs = llm_config_dicts(VllmAppArgs.model_validate(app["args"]))
    assert placement_problem(configs, _cluster(2)) is None
    assert placement_problem(configs, _cluster(0.5)) is not None


def test_an_autoscaling_cluster_is_judged_by_what_it_may_grow_to():
    gpu = _configs(2, num_gpus=1, device="cuda")
    head = {"CPU": 8.0}  # cluster.yaml: a CPU head, GPU workers added on demand
    assert "need GPU 2, the cluster has GPU 0" in placement_problem(gpu, capacity_of(head, [head]))
    # An autoscaler that reports its node types: at most 8 workers of 8 CPUs and one GPU.
    grows = capacity_of(head, [head], {"CPU": 72, "GPU": 8}, [head, {"CPU": 8, "GPU": 1}])
    assert grows.source == "the most its autoscaler's node types add up to"
    assert placement_problem(gpu, grows) is None
    assert "need GPU 9" in placement_problem(_configs(9, num_gpus=1, device="cuda"), grows)
    # One that does not say how far it may grow (Ray 2.60's v2 autoscaler): no check.
    assert capacity_of(head, [head], autoscaling=True) is None


def test_no_check_without_a_cluster():
    # `serve run <import path>` builds the app before it connects to Ray.
    assert cluster_capacity() is None
    check_placement(_configs(8))


# -- one real cluster ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """tests/vllm_health_scenarios.py: a 1-CPU Ray cluster of its own (a few minutes)."""
    from tests.vllm_support import run_scenarios

    return run_scenarios("vllm_health_scenarios.py", tmp_path_factory.mktemp("h") / "out.json")


@pytest.mark.slow
def test_real_serve_refuses_at_build_and_answers_for_an_unplaced_model(real):
    # The builder serve run's controller calls refuses the config file's two engines.
    refused = real["config_with_one_engine_too_many"]
    assert "the engine replicas need CPU 2, the cluster has CPU 1" in refused, refused

    # The same two engines deployed anyway: one is placed, the other waits for a CPU.
    placed, unplaced = real["placed"], real["unplaced"]
    health = real["healthz_while_one_is_unplaced"]
    assert health["status_code"] == 503 and health["body"]["status"] == "degraded"
    assert health["body"]["models"][unplaced]["state"] == NOT_PLACEABLE
    assert (
        "each needs CPU 1, the cluster has CPU 0 free of CPU 1"
        in (health["body"]["models"][unplaced]["reason"])
    )
    answer = real["request_to_unplaced"]
    assert answer["status_code"] == 503 and answer["seconds"] < 1.0
    assert answer["body"]["error"]["code"] == "model_not_placeable"
    assert f"model '{unplaced}'" in answer["body"]["error"]["message"]
    starting = real.get("request_to_starting")
    if starting is not None:  # the placed engine was still loading when asked
        assert starting["status_code"] == 503 and starting["seconds"] < 1.0
        assert starting["body"]["error"]["code"] == "model_starting"

    # Once the placed engine runs it serves; the unplaced one still gets its 503.
    assert real["request_to_placed"]["status_code"] == 200
    health = real["healthz_after"]
    assert health["status_code"] == 503
    assert health["body"]["models"][placed]["state"] == RUNNING
    assert health["body"]["models"][placed]["running_replicas"] == 1
    cards = {c["id"]: c["metadata"]["serving"] for c in real["models"]["data"]}
    assert cards[placed]["state"] == RUNNING and cards[unplaced]["state"] == NOT_PLACEABLE
