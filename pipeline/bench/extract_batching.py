"""Batched against one-at-a-time extraction on the same prompts (jobs.bench_extract): reference
tokens per second of the greedy generation alone and of the whole extraction (generation,
teacher-forced passes, junk tails), and whether both give the same rows.

Rows can differ only where float rounding of a padded batch flips a near-tie (a greedy argmax,
a sampled tail token or a router's top-k); the report counts what differs instead of hiding it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pipeline.data.prompts import Prompt
from pipeline.data.references import ReferenceSequence, build_references
from pipeline.extract.junk_tails import ACCEPTANCES
from pipeline.extract.rows import SequenceTables, extract_sequences
from pipeline.extract.teacher_forced import teacher_forced, teacher_forced_batch
from pipeline.models.loading import ModelPair


@dataclass(frozen=True)
class PathResult:
    batch_size: int
    reference_tokens: int
    generation_s: float
    extraction_s: float  # teacher-forced passes + junk tails, after generation
    forced_s: float  # the teacher-forced passes alone, timed apart (part of extraction_s)

    @property
    def generation_rate(self) -> float:
        return self.reference_tokens / self.generation_s

    @property
    def end_to_end_rate(self) -> float:
        return self.reference_tokens / (self.generation_s + self.extraction_s)


@dataclass(frozen=True)
class RowCheck:
    sequences: int
    same_references: int
    tokens_rows: int  # of the sequences with the same reference
    tokens_rows_same: int  # token, experts and draft_match identical
    max_prob_diff: float  # of draft_prob and target_prob
    tail_tokens: int
    tail_tokens_same: int  # token and experts identical


@dataclass(frozen=True)
class BatchingComparison:
    lone: PathResult
    batched: PathResult
    rows: RowCheck

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "generation_speedup": self.batched.generation_rate / self.lone.generation_rate,
            "end_to_end_speedup": self.batched.end_to_end_rate / self.lone.end_to_end_rate,
        }
        for name, r in (("unbatched", self.lone), ("batched", self.batched)):
            out[f"{name}_generation_ref_tok_per_s"] = r.generation_rate
            out[f"{name}_end_to_end_ref_tok_per_s"] = r.end_to_end_rate
            out[f"{name}_extraction_s"] = r.extraction_s
        out.update({f"rows_{k}": float(v) for k, v in vars(self.rows).items()})
        return out


def run_path(
    pair: ModelPair,
    prompts: list[Prompt],
    max_new_tokens: int,
    lmax: int,
    seed: int,
    batch_size: int,
    acceptances: tuple[str, ...],
    draws: int,
) -> tuple[PathResult, list[ReferenceSequence], list[SequenceTables]]:
    """Generation, then the whole extraction (shared tails), ``batch_size`` at a time."""
    started = time.perf_counter()
    refs = build_references(
        prompts, pair.target, pair.tokenizer, max_new_tokens, batch_size=batch_size
    )
    generation = time.perf_counter() - started
    started = time.perf_counter()
    tables = extract_sequences(
        pair,
        refs,
        lmax,
        "shared",
        seed,
        acceptances=acceptances,
        draws=draws,
        batch_size=batch_size,
    )
    extraction = time.perf_counter() - started
    started = time.perf_counter()
    for start in range(0, len(refs), batch_size):
        group = refs[start : start + batch_size]
        if batch_size > 1:
            teacher_forced_batch(pair, group)
        else:
            for ref in group:
                teacher_forced(pair, ref)
    forced = time.perf_counter() - started
    tokens = sum(r.n_tokens for r in refs)
    return PathResult(batch_size, tokens, generation, extraction, forced), refs, tables


def _experts(table) -> np.ndarray:
    return np.array(table.column("experts").to_pylist())


def check_rows(
    lone: tuple[list[ReferenceSequence], list[SequenceTables]],
    batched: tuple[list[ReferenceSequence], list[SequenceTables]],
) -> RowCheck:
    """Rows of the sequences whose references agree, compared exactly (probabilities: the
    largest difference)."""
    same_refs = rows = rows_same = tail = tail_same = 0
    prob_diff = 0.0
    for ra, ta, rb, tb in zip(*lone, *batched, strict=True):
        if ra != rb:
            continue
        same_refs += 1
        a, b = ta.tokens.to_pydict(), tb.tokens.to_pydict()
        rows += len(a["t"])
        same = np.array(a["token_id"]) == np.array(b["token_id"])
        same &= np.array([x == y for x, y in zip(a["draft_match"], b["draft_match"], strict=True)])
        same &= ~(_experts(ta.tokens) != _experts(tb.tokens)).any(axis=(1, 2))
        rows_same += int(same.sum())
        for name in ("draft_prob", "target_prob"):
            diff = np.abs(np.array(a[name][1:], float) - np.array(b[name][1:], float))
            prob_diff = max(prob_diff, float(diff.max(initial=0.0)))
        tok_a, tok_b = (t.tails.column("token_id").to_numpy() for t in (ta, tb))
        tail += len(tok_a)
        differs = (tok_a != tok_b) | (_experts(ta.tails) != _experts(tb.tails)).any(axis=(1, 2))
        tail_same += int((~differs).sum())
    return RowCheck(len(lone[0]), same_refs, rows, rows_same, prob_diff, tail, tail_same)


def compare_batching(
    pair: ModelPair,
    prompts: list[Prompt],
    max_new_tokens: int,
    lmax: int,
    seed: int,
    batch_size: int,
    acceptances: tuple[str, ...] = ACCEPTANCES,
    draws: int = 2,
) -> tuple[BatchingComparison, list[ReferenceSequence]]:
    """One-at-a-time, then batched, on the same prompts; returns the batched references too."""
    args = (pair, prompts, max_new_tokens, lmax, seed)
    lone, refs_a, tables_a = run_path(*args, 1, acceptances, draws)
    batched, refs_b, tables_b = run_path(*args, batch_size, acceptances, draws)
    rows = check_rows((refs_a, tables_a), (refs_b, tables_b))
    return BatchingComparison(lone, batched, rows), refs_b


def format_batching(result: BatchingComparison) -> str:
    lone, batched, rows = result.lone, result.batched, result.rows
    head = f"{'batch':>6}{'ref tok':>9}{'gen s':>8}{'gen tok/s':>11}{'extract s':>11}"
    head += f"{'(forced s)':>12}{'e2e tok/s':>11}"
    lines = ["", head]
    lines += [
        f"{r.batch_size:>6}{r.reference_tokens:>9,}{r.generation_s:>8.2f}"
        f"{r.generation_rate:>11,.0f}{r.extraction_s:>11.2f}{r.forced_s:>12.2f}"
        f"{r.end_to_end_rate:>11,.0f}"
        for r in (lone, batched)
    ]
    m = result.metrics()
    lines += [
        "",
        f"batch {batched.batch_size} over 1: generation {m['generation_speedup']:.2f}x, "
        f"end to end {m['end_to_end_speedup']:.2f}x reference tokens/s (aim >= 4x)",
        f"extraction after generation: {lone.extraction_s:.2f}s vs {batched.extraction_s:.2f}s "
        f"(teacher-forced passes alone: {lone.forced_s:.2f}s vs {batched.forced_s:.2f}s; the "
        "rest is the junk tails, per sequence either way)",
        f"rows: {rows.same_references}/{rows.sequences} references identical; of those, "
        f"{rows.tokens_rows_same:,}/{rows.tokens_rows:,} tokens rows identical (probabilities "
        f"within {rows.max_prob_diff:.1e}), {rows.tail_tokens_same:,}/{rows.tail_tokens:,} tail "
        "tokens identical (token and experts; a difference is a float near-tie)",
    ]
    return "\n".join(lines)
