"""The extraction pipeline on Ray Data: shards of prompts -> model-holding actors -> Parquet.

Each shard is a fixed group of prompts. A pool of actors, one per GPU (or CPU actors that
leave a core free for Ray Data's own read and bookkeeping tasks), each loads the target and
draft once, builds the shard's reference sequences, extracts them and writes the shard's
``sequences``, ``tokens``, ``tails`` and ``trees`` (empty without tree rules) files itself
(pipeline.data.shards), so a rerun skips every shard already written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy

from pipeline.data.prompts import Prompt
from pipeline.data.shards import check_manifest, completed_shards, write_shard
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.junk_tails import ACCEPTANCES, draws_per_acceptance
from pipeline.extract.rows import ExtractStats, extract_sequences
from pipeline.extract.tree_rows import tree_predictor

TABLES = ("sequences", "tokens", "tails", "trees")  # trees: empty unless rules are given


@dataclass(frozen=True)
class ExtractConfig:
    target: str
    draft: str
    out: str
    lmax: int = 8
    mode: str = "shared"
    seed: int = 0
    max_new_tokens: int = 128
    use_given: bool = False
    device: str = "auto"
    dtype: str = "auto"
    experts_implementation: str = "eager"
    chunk_tokens: int = 2048
    threads: int = 0  # torch threads per CPU actor; 0: share the node's cores among actors
    acceptances: tuple[str, ...] = ACCEPTANCES  # which junk tails (docs/contract.md, section 1)
    draws: int = 2  # independent tail draws per acceptance (greedy: one), for cross-fitting
    temperature: float = 1.0  # of draft_prob, target_prob and the sampled tails
    # Sequences decoded (greedy references) and teacher-forced together, within a shard; 1: each
    # alone. Kept in the manifest: float rounding differs with the batch, so may a near-tie.
    batch_size: int = 16
    # Draft-tree selection rules (pipeline.extract.draft_trees, e.g. "eagle2", "ecospec:d=3")
    # whose first tree_budget nodes at every state go to the trees table; ecospec reads the
    # expert predictor at `predictor`.
    trees: tuple[str, ...] = ()
    tree_budget: int = 12
    predictor: str | None = None

    def manifest(self, source: str, limit: int | None, shard_size: int) -> dict[str, Any]:
        """The parameters that determine the rows (device and threads do not)."""
        keep = asdict(self)
        for volatile in ("out", "device", "threads", "chunk_tokens"):
            keep.pop(volatile)
        keep["acceptances"] = list(self.acceptances)  # as JSON reads it back, for the comparison
        keep["trees"] = list(self.trees)
        return {**keep, "source": source, "limit": limit, "shard_size": shard_size}


class ShardExtractor:
    """Ray Data callable class: holds the models, turns a batch of shards into Parquet files."""

    def __init__(self, config: ExtractConfig) -> None:
        import torch

        from pipeline.models.loading import load_pair

        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.pair = load_pair(
            config.target, config.draft, config.device, config.dtype, config.experts_implementation
        )
        self.node_id = ray.get_runtime_context().get_node_id()
        self.rules = tuple(TreeRule.parse(r) for r in config.trees)
        self.predictor = tree_predictor(
            list(self.rules), config.predictor, self.pair.spec, self.pair.device
        )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from pipeline.data.references import build_references

        cfg = self.config
        rows: dict[str, list] = {"shard": [], "node_id": [], "stats": []}
        for shard, prompts_json in zip(batch["shard"], batch["prompts"], strict=True):
            started = time.perf_counter()
            prompts = [Prompt(**p) for p in json.loads(prompts_json)]
            refs = build_references(
                prompts,
                self.pair.target,
                self.pair.tokenizer,
                cfg.max_new_tokens,
                cfg.use_given,
                batch_size=cfg.batch_size,
            )
            parts = extract_sequences(
                self.pair,
                refs,
                cfg.lmax,
                cfg.mode,
                cfg.seed,
                cfg.chunk_tokens,
                acceptances=cfg.acceptances,
                draws=cfg.draws,
                temperature=cfg.temperature,
                batch_size=cfg.batch_size,
                trees=self.rules,
                tree_budget=cfg.tree_budget,
                predictor=self.predictor,
            )
            stats = ExtractStats()
            for part in parts:
                stats.add(part.stats)
            stats.seconds = time.perf_counter() - started
            tables = {name: pa.concat_tables([getattr(p, name) for p in parts]) for name in TABLES}
            write_shard(Path(cfg.out), int(shard), tables)
            rows["shard"].append(int(shard))
            rows["node_id"].append(self.node_id)
            rows["stats"].append(json.dumps(asdict(stats)))
        return {k: np.array(v) for k, v in rows.items()}


@dataclass(frozen=True)
class PoolPlan:
    actors: int
    num_gpus: float
    num_cpus: float
    threads: int


def plan_pool(actors: int | None = None, cpus_per_actor: float | None = None) -> PoolPlan:
    """One actor per GPU when the cluster has GPUs; otherwise CPU actors that leave one CPU
    for Ray Data's read and write tasks (on a 2-core machine a pool taking every CPU hangs)."""
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    cpus = float(resources.get("CPU", 1))
    if gpus:
        n = actors or gpus
        return PoolPlan(n, 1.0, cpus_per_actor or 1.0, 0)
    per = cpus_per_actor or 1.0
    n = actors or max(1, int((cpus - 1) // per))
    if n * per > cpus - 0.5 and cpus > 1:
        per = max(0.25, (cpus - 1) / n)
    threads = max(1, int(cpus // n))
    return PoolPlan(n, 0.0, per, threads)


def shard_prompts(prompts: list[Prompt], shard_size: int) -> list[list[Prompt]]:
    return [prompts[i : i + shard_size] for i in range(0, len(prompts), shard_size)]


def _fmt_eta(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f}s"


def run_extraction(
    config: ExtractConfig,
    prompts: list[Prompt],
    source: str,
    limit: int | None,
    shard_size: int = 4,
    actors: int | None = None,
    cpus_per_actor: float | None = None,
    overwrite: bool = False,
    log=print,
) -> dict[str, Any]:
    """Extract every shard not yet written; returns totals for this run and per-node counts."""
    if shard_size < 1:
        raise ValueError(f"shard size must be >= 1, got {shard_size}")
    # Refuse bad tail parameters here, not in every actor after the models are loaded.
    draws_per_acceptance(tuple(config.acceptances), config.draws)
    if not (math.isfinite(config.temperature) and config.temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {config.temperature}")
    if config.batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {config.batch_size}")
    rules = [TreeRule.parse(r) for r in config.trees]  # a bad rule fails here, named
    if rules and config.tree_budget < 1:
        raise ValueError(f"tree budget must be >= 1 draft node, got {config.tree_budget}")
    if any(r.selection == "ecospec" for r in rules) and not config.predictor:
        raise ValueError("an ecospec tree rule needs an expert predictor (--predictor)")
    out = Path(config.out)
    check_manifest(out, config.manifest(source, limit, shard_size), overwrite)
    shards = shard_prompts(prompts, shard_size)
    done = completed_shards(out, TABLES)
    todo = [k for k in range(len(shards)) if k not in done]
    log(f"[extract] {len(shards)} shards, {len(done)} already complete, {len(todo)} to do")
    totals = ExtractStats()
    per_node: dict[str, int] = {}
    if not todo:
        return {"stats": totals, "shards_done": 0, "shards_skipped": len(done), "nodes": per_node}

    plan = plan_pool(actors, cpus_per_actor)
    if not config.threads and plan.threads:
        config = ExtractConfig(**{**asdict(config), "threads": plan.threads})
    log(
        f"[extract] actor pool: {plan.actors} x (GPU {plan.num_gpus:g}, CPU {plan.num_cpus:g}), "
        f"{config.threads or 'default'} torch threads each"
    )
    items = [{"shard": k, "prompts": json.dumps([asdict(p) for p in shards[k]])} for k in todo]
    # Our own progress lines (sequences, tokens/s, ETA) replace Ray Data's periodic dumps.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Ray Data's usage collection starts a driver thread that polls the cluster every 10 s for
    # the rest of the process; one poll after ray.shutdown() makes Ray exit the process with
    # status 1 (a driver that starts Ray again, as the study and the tests do, dies mid-run).
    os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        ShardExtractor,
        fn_constructor_kwargs={"config": config},
        batch_size=1,
        compute=ActorPoolStrategy(size=plan.actors, max_tasks_in_flight_per_actor=1),
        num_gpus=plan.num_gpus or None,
        num_cpus=plan.num_cpus,
    )
    total_seqs = sum(len(shards[k]) for k in todo)
    started = time.perf_counter()
    rows = (
        {k: v[0] for k, v in batch.items()}
        for batch in ds.iter_batches(batch_size=1, prefetch_batches=0, batch_format="numpy")
    )
    for n_done, row in enumerate(rows, 1):
        stats = ExtractStats(**json.loads(row["stats"]))
        totals.add(stats)
        per_node[row["node_id"]] = per_node.get(row["node_id"], 0) + 1
        elapsed = time.perf_counter() - started
        rate = totals.reference_tokens / elapsed if elapsed else 0.0
        remaining = total_seqs - totals.sequences
        eta = elapsed / totals.sequences * remaining if totals.sequences else 0.0
        log(
            f"[extract] shard {row['shard']} done ({n_done}/{len(todo)}): "
            f"{totals.sequences}/{total_seqs} sequences, {totals.reference_tokens:,} reference "
            f"+ {totals.tail_tokens:,} tail tokens, {rate:,.0f} ref tok/s, "
            f"ETA {_fmt_eta(eta)}"
        )
    totals.seconds = time.perf_counter() - started
    return {
        "stats": totals,
        "shards_done": len(todo),
        "shards_skipped": len(done),
        "nodes": per_node,
    }
