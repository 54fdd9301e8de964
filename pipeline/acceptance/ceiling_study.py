"""The ceiling study behind jobs.acceptance_ceiling: per prompt domain and temperature, the
informed chain ceiling (pipeline.acceptance.ceiling) and, with a tree rule, the tree and
chain-or-tree ceilings (pipeline.acceptance.tree_ceiling), over the texts the target decodes
from the bench's own prompts, every step priced by the pair's cost model.

A step of the chain ceiling is T_D(k) + T_T(k + 1, U(k + 1), L); a tree step is T_D(draft
forwards) + T_T(m, U(m), L) for a pass of m positions, U the traced mean experts per layer of
a pass of m positions (acceptance.json) and L the context at that point of the text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from pipeline.acceptance.ceiling import Ceiling, ceiling
from pipeline.acceptance.model import AcceptanceModel
from pipeline.acceptance.sampled_candidates import (
    SampledCandidates,
    candidates_of,
    sampled_candidates_study,
)
from pipeline.acceptance.traces import (
    AcceptanceTrace,
    collect_traces,
    load_traces,
    prompt_ids,
    save_traces,
)
from pipeline.acceptance.tree_ceiling import texts_tree_ceiling
from pipeline.cost.model import CostModel
from pipeline.data.prompts import Prompt
from pipeline.decode.types import SamplingConfig
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.teacher_forced import TeacherForced
from pipeline.models.loading import ModelPair

Log = Callable[[str], None]


@dataclass(frozen=True)
class CeilingSettings:
    temperatures: list[float]
    max_new_tokens: int = 64
    max_k: int = 12
    fixed: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
    trees: TreeRule | None = None  # an eagle2 rule: the tree ceilings too
    traces: Path | None = None  # an .npz to save the traces to, or to read when it exists
    candidates: int = 4  # with trees at T > 0: up to this many sampled candidates a position


@dataclass
class CeilingStudy:
    results: dict[tuple[str, float], Ceiling]  # (domain, temperature) -> its ceilings
    trees: TreeRule | None
    # (domain, T > 0) -> what several candidates for a position buy there.
    candidates: dict[tuple[str, float], SampledCandidates] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out = {
            f"{name}_T{temp:g}_ceiling_over_best_fixed": res.gain_over_best_fixed
            for (name, temp), res in self.results.items()
        }
        for (name, temp), res in self.results.items():
            if res.tree is not None:
                for kind, gain in res.tree.over_best_fixed().items():
                    out[f"{name}_T{temp:g}_{kind}_over_best_fixed"] = gain
        for (name, temp), cands in self.candidates.items():
            for i, (a, b) in enumerate(zip(cands.sampled, cands.top, strict=True), 1):
                out[f"{name}_T{temp:g}_sampled{i}_acceptance"] = a
                out[f"{name}_T{temp:g}_top{i}_acceptance"] = b
            for width, ceil in cands.leaves.items():
                gain = ceil.over_best_fixed()["chain_or_tree"]
                out[f"{name}_T{temp:g}_chain_or_leaves{width}_over_best_fixed"] = gain
        return out

    def tree_table(self, max_k: int) -> str:
        """The tree ceilings beside the chains', over the best fixed K (empty without trees)."""
        if self.trees is None:
            return ""
        lines = [
            f"over the best fixed K, trees of {self.trees.name} up to {max_k} nodes",
            "domain  T    chains  trees  chain-or-tree  (modelled)",
        ]
        for (name, temp), res in self.results.items():
            assert res.tree is not None
            gains = res.tree.over_best_fixed()
            lines.append(
                f"{name:6s}  {temp:<4g} {gains['chain']:>6.3f}x {gains['tree']:>6.3f}x "
                f"{gains['chain_or_tree']:>13.3f}x"
            )
        return "\n".join(lines)

    def candidates_table(self) -> str:
        """One position's acceptance with i candidates, drawn from q (recursive rejection
        sampling) or the draft's top-i, and the ceilings of chains with sampled leaves beside
        every token (empty without trees at T > 0)."""
        if not self.candidates:
            return ""
        first = next(iter(self.candidates.values()))
        head = " ".join(f"{'i=' + str(i):>6s}" for i in range(1, len(first.sampled) + 1))
        widths = " ".join(f"{'w=' + str(w):>7s}" for w in first.leaves)
        lines = [
            "one position's acceptance with i candidates (mean over the texts' positions)",
            f"domain  T    candidates    {head}",
        ]
        for (name, temp), cands in self.candidates.items():
            for kind, values in (("drawn from q", cands.sampled), ("draft's top-i", cands.top)):
                cells = " ".join(f"{v:>6.3f}" for v in values)
                lines.append(f"{name:6s}  {temp:<4g} {kind:13s} {cells}")
        lines += [
            "",
            "over the best fixed K: chains, or chains with w - 1 sampled leaves beside every",
            "token (no draft forward; recursive rejection sampling), whichever is cheaper",
            f"domain  T    chains {widths}  (modelled)",
        ]
        for (name, temp), cands in self.candidates.items():
            chains = self.results[(name, temp)].gain_over_best_fixed
            cells = " ".join(
                f"{c.over_best_fixed()['chain_or_tree']:>6.3f}x" for c in cands.leaves.values()
            )
            lines.append(f"{name:6s}  {temp:<4g} {chains:>5.3f}x {cells}")
        return "\n".join(lines)


def tree_step(cost: CostModel, acceptance: AcceptanceModel, context: int):
    """The price of a step of ``forwards`` draft forwards verifying m positions at text
    position ``pos`` (the tree ceiling's steps)."""

    def step(forwards: int, m: int, pos: int) -> float:
        return cost.t_draft(forwards) + cost.t_target(m, acceptance.union(m), context + pos)

    return step


def chain_step(cost: CostModel, acceptance: AcceptanceModel, context: int):
    """The chain ceiling's price of drafting k tokens at text position t: k forwards, a pass of
    k + 1 positions."""
    step = tree_step(cost, acceptance, context)
    return lambda k, t: step(k, k + 1, t)


def ceiling_study(
    pair: ModelPair,
    prompts: dict[str, list[Prompt]],
    cost: CostModel,
    acceptance: AcceptanceModel,
    settings: CeilingSettings,
    log: Log = print,
) -> CeilingStudy:
    """Trace (or read the traces), then every domain's ceilings at every temperature, each
    logged as it is solved."""
    flat = [p for chosen in prompts.values() for p in chosen]
    traces = _traces(pair, flat, settings, log)
    ids_of = {p.prompt_id: prompt_ids(pair, p) for p in flat}
    results: dict[tuple[str, float], Ceiling] = {}
    candidates: dict[tuple[str, float], SampledCandidates] = {}
    log("\ndomain  T    best fixed K  ceiling over best fixed  ceiling over ar  (modelled)")
    for temp in settings.temperatures:
        for name, chosen in prompts.items():
            ids = {p.prompt_id for p in chosen}
            mine = [t for t in traces if t.temperature == temp and t.prompt_id in ids]
            if not mine:
                raise ValueError(
                    f"no traces of {name} at T={temp:g} in {settings.traces}: remove the file "
                    "to trace again"
                )
            steps = [chain_step(cost, acceptance, len(ids_of[t.prompt_id])) for t in mine]
            res = ceiling(
                [t.labels for t in mine], steps.__getitem__, settings.max_k, list(settings.fixed)
            )
            results[(name, temp)] = res
            log(
                f"{name:6s}  {temp:<4g} {res.best_k:>12d}  {res.gain_over_best_fixed:>22.3f}x"
                f"  {res.speedup_over_ar:>14.3f}x"
            )
            if settings.trees is not None:
                texts = [_tree_text(t, ids_of, cost, acceptance, settings) for t in mine]
                sampling = SamplingConfig(temperature=temp)
                firsts: list = []  # T > 0: each text's candidates, off the trees' own pass
                res.tree = texts_tree_ceiling(
                    pair,
                    texts,
                    sampling,
                    settings.trees,
                    settings.max_k,
                    list(settings.fixed),
                    each_forced=(
                        partial(_keep_candidates, firsts, sampling, settings.candidates)
                        if temp > 0
                        else None
                    ),
                )
                if temp > 0:
                    candidates[(name, temp)] = sampled_candidates_study(
                        pair,
                        texts,
                        sampling,
                        settings.candidates,
                        settings.max_k,
                        list(settings.fixed),
                        firsts=firsts,
                    )
    return CeilingStudy(results, settings.trees, candidates)


def _keep_candidates(firsts: list, sampling: SamplingConfig, k: int, forced: TeacherForced) -> None:
    """One text's candidates (sampled, top-i), off the tree ceiling's teacher-forced pass."""
    firsts.append(candidates_of(forced, sampling, k))


def _traces(
    pair: ModelPair, flat: list[Prompt], settings: CeilingSettings, log: Log
) -> list[AcceptanceTrace]:
    path = settings.traces
    if path is not None and path.exists():
        traces, _, _ = load_traces(path)
        if any(t.depth is not None for t in traces):
            raise ValueError(
                f"{path} holds an EAGLE-3 head's chains (jobs.train_acceptance's); the ceiling "
                "replays positions one after another: give another --traces path"
            )
        log(f"{len(traces)} traces read from {path}")
        return traces
    log(
        f"tracing {len(flat)} prompts x T in {settings.temperatures}, "
        f"{settings.max_new_tokens} tokens each"
    )
    traces, unions = collect_traces(
        pair,
        flat,
        settings.temperatures,
        settings.max_new_tokens,
        1,
        log=log,
        chains=False,  # the ceiling replays positions one after another
    )
    if path is not None:
        save_traces(path, traces, unions, {"prompts": [p.prompt_id for p in flat]})
    return traces


def _tree_text(
    trace: AcceptanceTrace,
    ids_of: dict[str, list[int]],
    cost: CostModel,
    acceptance: AcceptanceModel,
    settings: CeilingSettings,
):
    if trace.tokens is None:
        raise ValueError(
            f"{settings.traces} holds traces without their texts (saved before --trees "
            "existed): remove the file to trace again"
        )
    ids = ids_of[trace.prompt_id]
    return ids, trace.tokens, trace.labels, tree_step(cost, acceptance, len(ids))
