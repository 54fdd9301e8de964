"""Every registered single-session policy on a device (CUDA when present): with the embedded
target and each draft, greedy tokens equal to plain greedy's (`ar`), and a T = 1 run of each
completes. Exits 1 when any policy differs or fails (each one is reported first).

    python -m tools.engine_on_device                     # cuda when present, float32
    python -m tools.engine_on_device --device cpu --threads 1 --policies ar,fixed,throughput
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from jobs.cli import add_device_args, add_max_new_tokens_arg, add_threads_arg, parser, torch_threads
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_pair_artifacts
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import DEFAULT_DRAFT, DEFAULT_HEAD, load_pair

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The history of the river begins",
    "Question: what is 17 * 23? Answer:",
]
# name -> (draft, artifacts directory; None: the embedded pair's under models/)
PAIRS = {"draft (1 layer)": (DEFAULT_DRAFT, None), "eagle3 head": (DEFAULT_HEAD, DEFAULT_HEAD)}
PAIR_CHOICES = {"draft": "draft (1 layer)", "head": "eagle3 head"}
SKIP = {"batch"}  # decodes several requests at once; not a single-session policy


def single_session_policies() -> list[str]:
    return sorted(set(POLICIES) - SKIP)


def check_pair(label: str, pair, artifacts, names: list[str], max_new_tokens: int) -> int:
    """Print one line per policy; the number that failed (tokens differ or an error)."""
    engine = SpeculativeEngine(pair)
    device_name = torch.cuda.get_device_name() if pair.device.type == "cuda" else "cpu"
    print(f"== {label} on {pair.device} ({device_name})", flush=True)
    ids = [pair.tokenizer(p)["input_ids"] for p in PROMPTS]
    ar = make_policy("ar")
    reference = [engine.generate(i, ar, max_new_tokens, stop_at_eos=False).tokens for i in ids]
    failures = 0
    for name in names:
        try:
            t0 = time.perf_counter()
            out = [
                engine.generate(i, make_policy(name, artifacts), max_new_tokens, stop_at_eos=False)
                for i in ids
            ]
            greedy_s = time.perf_counter() - t0
            equal = all(o.tokens == r for o, r in zip(out, reference, strict=True))
            accepted = sum(o.mean_accepted for o in out) / len(out)
            t1 = [
                engine.generate(
                    i,
                    make_policy(name, artifacts),
                    max_new_tokens,
                    SamplingConfig(1.0),
                    seed=j,
                    stop_at_eos=False,
                )
                for j, i in enumerate(ids)
            ]
            print(
                f"  {name:14s} greedy==ar {equal!s:5s} accepted/step {accepted:.2f} "
                f"({greedy_s:.2f} s)  T=1 tokens {[len(o.tokens) for o in t1]}",
                flush=True,
            )
            failures += not equal
        except Exception:  # report every policy, then fail
            failures += 1
            print(f"  {name:14s} FAILED\n{traceback.format_exc()}", flush=True)
    return failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("tools.engine_on_device", __doc__)
    add_device_args(p)
    p.set_defaults(dtype="float32")
    p.add_argument(
        "--pairs",
        default="draft,head",
        help="comma-separated: draft (the embedded 1-layer draft), head (the EAGLE-3 head) "
        "(draft,head)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated policy names (default: every registered single-session policy)",
    )
    add_max_new_tokens_arg(p, 32)
    add_threads_arg(p, None, "on a CPU")
    args = p.parse_args(argv)
    pairs = [x.strip() for x in args.pairs.split(",") if x.strip()]
    if not pairs or set(pairs) - set(PAIR_CHOICES):
        p.error(f"--pairs: names among {', '.join(PAIR_CHOICES)}")
    args.pairs = [PAIR_CHOICES[x] for x in pairs]
    allowed = single_session_policies()
    if args.policies is None:
        args.policies = allowed
    else:
        args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        if not args.policies or set(args.policies) - set(allowed):
            p.error(f"--policies: names among {', '.join(allowed)}")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    failures = 0
    with torch_threads(args.threads):
        for label in args.pairs:
            draft, art_dir = PAIRS[label]
            pair = load_pair(
                draft=draft,
                device=args.device,
                dtype=args.dtype,
                experts_implementation=args.experts_implementation,
            )
            artifacts = load_pair_artifacts(art_dir, device=str(pair.device))
            failures += check_pair(label, pair, artifacts, args.policies, args.max_new_tokens)
    print(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
