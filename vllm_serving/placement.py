"""Whether the cluster can hold the vLLM app's engine replicas: what they need at their minimum
count (``engine_demand``), what the cluster has (``capacity_of``: its nodes now, or the most
its autoscaler's node types add up to), and the refusal the app builder and
``python -m vllm_serving.run`` give when it cannot (with the shortfall)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("ray.serve")


def engine_demand(configs: list[dict]) -> dict[str, float]:
    """Resources the app's engine replicas hold at their minimum count: each model id's
    placement-group bundles, once per replica (the actors themselves ask for none)."""
    demand: dict[str, float] = {}
    for config in configs:
        replicas = config["deployment_config"]["autoscaling_config"]["min_replicas"]
        for bundle in config["placement_group_config"]["bundles"]:
            for resource, amount in bundle.items():
                demand[resource] = demand.get(resource, 0.0) + replicas * amount
    return demand


def shortfall(demand: dict[str, float], cluster: dict[str, float]) -> str | None:
    """Why the cluster cannot hold the demand, or None. Checked before deploying: Serve's own
    "taken more than 30s to be scheduled" also appears for replicas that are merely slow to
    start on a loaded machine, so it cannot tell the two apart."""
    short = [
        f"{resource} {need:g} > {cluster.get(resource, 0.0):g}"
        for resource, need in demand.items()
        if need > cluster.get(resource, 0.0) + 1e-9
    ]
    if not short:
        return None
    return (
        f"the engine replicas need {', '.join(short)} in the cluster (one bundle per model id "
        "and replica): raise --num-cpus, or lower engine_cpus, min_replicas or the models"
    )


def _resources(amounts: dict[str, float]) -> str:
    """{"CPU": 1.0, "GPU": 0.0} -> "CPU 1" (Ray's node:... and memory entries left out)."""
    shown = [
        f"{name} {amount:g}"
        for name, amount in amounts.items()
        if amount and not name.startswith("node:") and "memory" not in name
    ]
    return ", ".join(shown) or "nothing"


@dataclass(frozen=True)
class Capacity:
    """What a cluster can hold: in all, and on one node (each node, or node type)."""

    total: dict[str, float]
    nodes: list[dict[str, float]]
    source: str  # how it was found, for the message


def _fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(r, 0.0) + 1e-9 >= amount for r, amount in bundle.items())


def placement_problem(configs: list[dict], capacity: Capacity) -> str | None:
    """Why ``capacity`` cannot hold the engine replicas of ``configs`` (llm_config_dicts) at
    their minimum count, naming what they need and what the cluster has; or None."""
    demand = engine_demand(configs)
    short = {
        r: (need, capacity.total.get(r, 0.0))
        for r, need in demand.items()
        if need > capacity.total.get(r, 0.0) + 1e-9
    }
    unfit = []
    for config in configs:
        for bundle in config["placement_group_config"]["bundles"]:
            if capacity.nodes and not any(_fits(bundle, n) for n in capacity.nodes):
                unfit.append(f"{config['model_loading_config']['model_id']}'s {_resources(bundle)}")
    if not short and not unfit:
        return None
    each = "; ".join(
        f"{c['model_loading_config']['model_id']}: "
        f"{c['deployment_config']['autoscaling_config']['min_replicas']} x "
        f"{' + '.join(_resources(b) for b in c['placement_group_config']['bundles'])}"
        for c in configs
    )
    parts = []
    if short:
        needs = ", ".join(f"{r} {need:g}" for r, (need, _) in short.items())
        has = ", ".join(f"{r} {have:g}" for r, (_, have) in short.items())
        parts.append(f"the engine replicas need {needs}, the cluster has {has} ({capacity.source})")
    if unfit:
        parts.append(f"no node can hold one engine's bundle ({', '.join(unfit)})")
    return (
        f"{'; '.join(parts)}. Engine bundles at min_replicas: {each}. Lower engine_cpus, "
        "num_gpus, min_replicas or the models, or give the cluster more"
    )


def capacity_of(
    total: dict[str, float],
    nodes: list[dict[str, float]],
    autoscaler_max: dict[str, float] | None = None,
    node_groups: list[dict[str, float]] | None = None,
    autoscaling: bool = False,
) -> Capacity | None:
    """What the builder checks against: the most the autoscaler's node types add up to where
    the cluster reports them; None (no check) where an autoscaler runs that does not (Ray
    2.60's v2 autoscaler, the one `ray up` starts: it may add nodes, how many is not known
    here); else the nodes up now."""
    if autoscaler_max:
        return Capacity(
            {k: float(v) for k, v in autoscaler_max.items()},
            [{k: float(v) for k, v in g.items()} for g in node_groups or []],
            "the most its autoscaler's node types add up to",
        )
    if autoscaling:
        return None
    return Capacity(dict(total), [dict(n) for n in nodes], "its resources now")


def cluster_capacity() -> Capacity | None:
    """The connected cluster's capacity (``capacity_of``), or None when this process is not
    connected to Ray (`serve run <import path>` calls the builder before it connects)."""
    import ray

    if not ray.is_initialized():
        return None
    maximum, groups, autoscaling = None, [], False
    try:  # internal APIs (what Ray Train checks its workers against); without them, as it is
        from ray._private.state import state
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        config = state.get_cluster_config()
        if config is not None:
            maximum = state.get_max_resources_from_cluster_config()
            groups = [dict(g.resources) for g in config.node_group_configs if g.max_count != 0]
        autoscaling = is_autoscaler_v2(fetch_from_server=True)
    except Exception as exc:
        log.info("placement check: no autoscaler information (%r)", exc)
    nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    capacity = capacity_of(ray.cluster_resources(), nodes, maximum, groups, autoscaling)
    if capacity is None:
        log.info("placement check skipped: the cluster's autoscaler may add nodes")
    return capacity


def check_placement(configs: list[dict], capacity: Capacity | None = None) -> None:
    """Refuse, at build, an app the cluster cannot hold (``capacity``: the connected
    cluster's; nothing is checked when there is none)."""
    capacity = capacity or cluster_capacity()
    if capacity is None:
        return
    if problem := placement_problem(configs, capacity):
        raise RuntimeError(f"the vLLM app cannot place its engine replicas: {problem}")
