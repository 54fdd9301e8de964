"""Benchmark of the two junk-tail modes on the same reference sequences, in one run
(jobs.bench_extract): wall time, target forwards and mean U per mode, and the printed report."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pipeline.data.references import ReferenceSequence
from pipeline.extract.rows import extract_sequence
from pipeline.models.loading import ModelPair
from pipeline.oracle.union_from_tables import sequence_union_table


@dataclass(frozen=True)
class ModeResult:
    mode: str
    seconds: float
    reference_tokens: int
    tail_tokens: int
    target_forwards_per_ref_token: float
    # The same without the prompt prefill (x_1..x_{L_prompt-1}), which any method pays once.
    target_forwards_per_ref_token_excl_prompt: float
    mean_u: float
    cells: int


def bench_mode(
    pair: ModelPair, refs: list[ReferenceSequence], lmax: int, mode: str, seed: int
) -> ModeResult:
    u_values: list[np.ndarray] = []
    ref_tokens = tail_tokens = target_forwards = prompt_tokens = 0
    seconds = 0.0
    for ref in refs:
        started = time.perf_counter()
        # One set of tails (the paper's surrogate, one draw): the modes differ in layout only.
        out = extract_sequence(pair, ref, lmax, mode, seed, acceptances=("surrogate",), draws=1)
        seconds += time.perf_counter() - started
        table = sequence_union_table(out.tokens, out.tails, pair.spec, lmax)
        u_values.append(table[~np.isnan(table)])
        ref_tokens += out.stats.reference_tokens
        tail_tokens += out.stats.tail_tokens
        target_forwards += out.stats.target_token_forwards
        prompt_tokens += out.stats.prompt_tokens - 1  # x_0 is verified in round 0
    all_u = np.concatenate(u_values)
    return ModeResult(
        mode=mode,
        seconds=seconds,
        reference_tokens=ref_tokens,
        tail_tokens=tail_tokens,
        target_forwards_per_ref_token=target_forwards / max(1, ref_tokens),
        target_forwards_per_ref_token_excl_prompt=(target_forwards - prompt_tokens)
        / max(1, ref_tokens),
        mean_u=float(all_u.mean()),
        cells=len(all_u),
    )


@dataclass(frozen=True)
class TailModeComparison:
    shared: ModeResult
    paper: ModeResult
    lmax: int

    @property
    def speedup(self) -> float:
        """Wall time of `paper` over `shared`."""
        return self.paper.seconds / self.shared.seconds

    @property
    def u_gap(self) -> float:
        """Relative gap of the mean U; both modes give every cell a correctly distributed tail,
        so it must stay small."""
        return abs(self.shared.mean_u - self.paper.mean_u) / self.paper.mean_u

    def metrics(self) -> dict[str, float]:
        return {
            "speedup_shared_over_paper": self.speedup,
            "mean_u_gap": self.u_gap,
            **{
                f"{r.mode}_{k}": v
                for r in (self.shared, self.paper)
                for k, v in vars(r).items()
                if k != "mode"
            },
        }


def compare_tail_modes(
    pair: ModelPair, refs: list[ReferenceSequence], lmax: int, seed: int
) -> TailModeComparison:
    """`shared` then `paper` on the same references."""
    shared = bench_mode(pair, refs, lmax, "shared", seed)
    paper = bench_mode(pair, refs, lmax, "paper", seed)
    return TailModeComparison(shared, paper, lmax)


def format_comparison(result: TailModeComparison) -> str:
    """A row per mode, then the speedup, target forwards per reference token and U gap."""
    shared, paper = result.shared, result.paper
    lines = [
        "",
        f"{'mode':<8}{'wall s':>9}{'tail tokens':>13}{'target fwd/ref tok':>20}"
        f"{'mean U':>9}{'cells':>8}",
    ]
    lines += [
        f"{r.mode:<8}{r.seconds:>9.2f}{r.tail_tokens:>13,}"
        f"{r.target_forwards_per_ref_token:>20.2f}{r.mean_u:>9.3f}{r.cells:>8,}"
        for r in (shared, paper)
    ]
    lines += [
        "",
        f"shared is {result.speedup:.1f}x faster than paper (wall time, same sequences, one run)",
        f"target token-forwards per reference token: shared "
        f"{shared.target_forwards_per_ref_token:.2f} (aim <= Lmax + 2 = {result.lmax + 2}), "
        f"paper {paper.target_forwards_per_ref_token:.2f}; without the prompt prefill: shared "
        f"{shared.target_forwards_per_ref_token_excl_prompt:.2f}, "
        f"paper {paper.target_forwards_per_ref_token_excl_prompt:.2f}",
        f"mean U(i,k,a): shared {shared.mean_u:.3f} vs paper {paper.mean_u:.3f} "
        f"({result.u_gap:.2%} apart; must be < 3%)",
    ]
    return "\n".join(lines)
