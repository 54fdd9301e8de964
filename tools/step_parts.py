"""Where each policy's time per token goes, measured, beside its modelled prices: the policies
interleaved prompt by prompt over the domains' first prompts, T = 0, one torch thread.

    python -m tools.step_parts --policies fixed:k=3,specdec,throughput --domains code --passes 3
    python -m tools.step_parts --draft models/eagle3-head --artifacts models/eagle3-head \\
        --policies fixed:k=5,specdec,throughput --passes 3

Each policy is NAME[:knob=value...] as in bench_online's --policies, optionally followed by
@FILE (that policy with another acceptance.json) and/or #FILE (with another costmodel.json),
e.g. throughput#/tmp/cal/costmodel.json. The modelled columns price with the artifacts'
cost model (not a #FILE one).

Columns: tok/s, ms per token (draft, verify, acceptance walk, the rest), steps, draft forwards
per step, tokens fed per forward, ms per forward, modelled draft and verify ms per token,
measured over modelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict
from pathlib import Path

from jobs.cli import (
    add_limit_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_threads_arg,
    parse_policy_specs,
    parser,
    run,
    torch_threads,
)
from pipeline.acceptance.model import AcceptanceModel
from pipeline.cost.model import CostModel
from pipeline.data.domains import DOMAINS, load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies.artifacts import PolicyArtifacts, load_pair_artifacts
from pipeline.decode.policies.registry import make_policy, validate_knobs
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

HEADER = (
    f"{'policy':36s} tok/s ms/tok draft verify accept other | steps fw/step tok/fw ms/fw "
    "model_d model_v meas/mod_d meas/mod_v"
)


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """One column of the table: a registered policy, its knobs and the files it reads instead
    of the artifacts' own."""

    text: str
    name: str
    knobs: dict
    acceptance: Path | None = None
    costmodel: Path | None = None

    def build(self, artifacts: PolicyArtifacts):
        if self.costmodel is not None:
            artifacts = dataclasses.replace(artifacts, cost=CostModel.load(self.costmodel))
        if self.acceptance is not None:
            artifacts = dataclasses.replace(
                artifacts, acceptance=AcceptanceModel.load(self.acceptance)
            )
        return make_policy(self.name, artifacts, **self.knobs)


def parse_spec(text: str) -> PolicySpec:
    """NAME[:knob=value...][@ACCEPTANCE_JSON][#COSTMODEL_JSON] -> a PolicySpec (knobs checked
    against the registry)."""
    rest, _, costmodel = text.partition("#")
    rest, _, acceptance = rest.partition("@")
    ((name, knobs),) = parse_policy_specs(rest)
    validate_knobs(name, knobs)
    return PolicySpec(
        text,
        name,
        knobs,
        Path(acceptance) if acceptance else None,
        Path(costmodel) if costmodel else None,
    )


def measure(
    engine: SpeculativeEngine,
    artifacts: PolicyArtifacts,
    specs: list[PolicySpec],
    prompts: list[list[int]],
    passes: int,
    max_new_tokens: int,
) -> dict[str, dict[str, float]]:
    """Per policy: the sums over every pass and prompt of wall time, tokens, steps, each part's
    measured time, draft forwards and tokens fed, and the modelled draft and verify times."""
    sums: dict[str, dict[str, float]] = {s.text: defaultdict(float) for s in specs}
    greedy = SamplingConfig(temperature=0.0)
    with frozen_heap():  # no full collection inside a timed decode
        for _ in range(passes):
            for ids in prompts:
                for spec in specs:
                    session = engine.start(ids, spec.build(artifacts), greedy, seed=0)
                    t0 = time.perf_counter()
                    while len(session.generated) < max_new_tokens:
                        session.step()
                    a = sums[spec.text]
                    a["wall"] += (time.perf_counter() - t0) * 1e3
                    a["tok"] += len(session.generated)
                    a["steps"] += len(session.steps)
                    for st in session.steps:
                        a["draft"] += st.t_draft_ms
                        a["verify"] += st.t_verify_ms
                        a["accept"] += st.t_accept_ms
                        a["fw"] += st.draft_forwards
                        a["dtok"] += st.draft_tokens
                        a["mdraft"] += artifacts.cost.t_draft(st.draft_forwards)
                        a["mverify"] += artifacts.cost.t_target(st.verified, st.u_bar, 0)
    return sums


def format_table(sums: dict[str, dict[str, float]]) -> str:
    lines = [HEADER]
    for text, a in sums.items():
        t, fw, steps = a["tok"], max(a["fw"], 1), max(a["steps"], 1)
        other = a["wall"] - a["draft"] - a["verify"] - a["accept"]
        lines.append(
            f"{text:36s} {1e3 * t / a['wall']:5.1f} {a['wall'] / t:6.3f} {a['draft'] / t:5.3f} "
            f"{a['verify'] / t:6.3f} {a['accept'] / t:6.3f} {other / t:5.3f} | {a['steps']:5.0f} "
            f"{a['fw'] / steps:7.2f} {a['dtok'] / fw:6.2f} {a['draft'] / fw:5.3f} "
            f"{a['mdraft'] / t:7.3f} {a['mverify'] / t:7.3f} "
            f"{a['draft'] / max(a['mdraft'], 1e-9):10.3f} "
            f"{a['verify'] / max(a['mverify'], 1e-9):10.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("tools.step_parts", __doc__)
    add_model_args(p)
    p.add_argument(
        "--artifacts",
        type=Path,
        default=None,
        help="directory of the pair's costmodel.json, acceptance.json (and policy.json, "
        "predictor/ where it has them); default: the embedded pair's under models/",
    )
    p.add_argument(
        "--policies",
        required=True,
        help="comma-separated NAME[:knob=value...][@ACCEPTANCE_JSON][#COSTMODEL_JSON]",
    )
    p.add_argument(
        "--domains",
        default=",".join(DOMAINS),
        help=f"comma-separated prompt domains ({','.join(DOMAINS)})",
    )
    add_limit_arg(p, 8, "per domain")
    add_max_new_tokens_arg(p, 64)
    p.add_argument("--passes", type=int, default=2, help="passes over the prompts (2)")
    add_threads_arg(p, 1)
    args = p.parse_args(argv)
    try:
        args.policies = [parse_spec(s.strip()) for s in args.policies.split(",") if s.strip()]
    except ValueError as exc:
        p.error(f"--policies: {exc}")
    args.domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    if not args.domains or set(args.domains) - set(DOMAINS):
        p.error(f"--domains: names among {', '.join(DOMAINS)}")
    if min(args.limit, args.max_new_tokens, args.passes) < 1:
        p.error("--limit, --max-new-tokens and --passes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with torch_threads(args.threads):
        pair = load_pair(
            args.target, args.draft, args.device, args.dtype, args.experts_implementation
        )
        artifacts = load_pair_artifacts(args.artifacts, str(pair.device))
        prompts = [
            encode(pair.tokenizer, p.text, keep_last=512)
            for domain in args.domains
            for p in load_prompts(domain, args.limit)
        ]
        sums = measure(
            SpeculativeEngine(pair),
            artifacts,
            args.policies,
            prompts,
            args.passes,
            args.max_new_tokens,
        )
    print(format_table(sums), flush=True)


if __name__ == "__main__":
    run(main)
