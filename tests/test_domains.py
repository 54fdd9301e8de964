"""The shipped multi-domain prompt sets (code, prose, math) and their loaders."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest

from pipeline.data.domains import (
    ALL_DOMAINS,
    DOMAINS,
    REPO_ROOT,
    UnknownDomainError,
    load_all_domains,
    load_domain,
    load_domains,
    load_prompts,
)
from pipeline.data.prompts import PromptSourceError, encode, load_jsonl
from pipeline.models.loading import DEFAULT_TARGET, load_tokenizer

SIZES = {"code": 164, "prose": 40, "math": 40}
PROSE_CATEGORIES = {"writing", "qa", "summarization", "translation"}


def test_domain_table_points_at_shipped_files() -> None:
    assert list(DOMAINS) == ["code", "prose", "math"]
    assert DOMAINS["code"] == "humaneval"
    for name in ("prose", "math"):
        path = Path(DOMAINS[name])
        assert path.is_absolute() and path.is_file()
        assert path.is_relative_to(REPO_ROOT)


def test_shipped_files_are_not_git_ignored() -> None:
    """A fresh clone must contain them (exit code 1: no ignore rule matches)."""
    files = [str(Path(DOMAINS[n]).relative_to(REPO_ROOT)) for n in ("prose", "math")]
    try:
        result = subprocess.run(
            ["git", "check-ignore", *files], cwd=REPO_ROOT, capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if result.returncode == 128:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    assert result.returncode == 1, f"git-ignored: {result.stdout}"


@pytest.mark.parametrize("name", list(SIZES))
def test_each_domain_loads(name: str) -> None:
    prompts = load_domain(name)
    assert len(prompts) == SIZES[name]
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert all(p.category == name for p in prompts)
    assert all(p.text.strip() for p in prompts)


def test_shipped_files_parse_with_the_spec_bench_loader() -> None:
    prose = load_jsonl(DOMAINS["prose"])
    math = load_jsonl(DOMAINS["math"])
    assert len(prose) == 40 and len(math) == 40
    counts = Counter(p.category for p in prose)
    assert set(counts) == PROSE_CATEGORIES and min(counts.values()) >= 6
    # Categories interleaved, so a small limit still samples each kind of prose.
    assert {p.category for p in prose[:4]} == PROSE_CATEGORIES
    # The original category stays recoverable from the id.
    assert all(p.prompt_id.startswith(f"prose-{p.category}-") for p in prose)
    for p in prose:
        if p.category in ("qa", "translation"):
            assert p.reference and p.reference.strip(), p.prompt_id
        if p.category == "summarization":
            assert "Summarize" in p.text.splitlines()[-1], p.prompt_id
    assert {p.category for p in math} == {"math_reasoning"}
    for p in math:
        assert p.prompt_id.startswith("math-")
        # GSM8K-style: a worked answer ending in "#### <number>".
        assert p.reference is not None, p.prompt_id
        work, _, answer = p.reference.rpartition(" #### ")
        assert work and float(answer) >= 0, p.prompt_id


def test_domain_limit() -> None:
    assert [p.prompt_id for p in load_domain("math", 3)] == ["math-01", "math-02", "math-03"]
    assert load_domain("prose", 0) == []
    assert [p.prompt_id for p in load_domain(" Code ", 2)] == ["HumanEval/0", "HumanEval/1"]
    with pytest.raises(PromptSourceError, match="limit"):
        load_domain("math", -1)


def test_load_domains_interleaves_and_respects_limits() -> None:
    prompts = load_domains(["math", "code", "prose"], limit_per_domain=3)
    assert [p.category for p in prompts] == ["math", "code", "prose"] * 3
    assert [p.prompt_id for p in prompts[:3]] == ["math-01", "HumanEval/0", "prose-writing-01"]
    assert len({p.prompt_id for p in prompts}) == 9
    # Without a limit a domain that runs out drops out and the rest follow in order.
    every = load_domains(["prose", "code"])
    assert len(every) == 40 + 164
    assert [p.category for p in every[:80]] == ["prose", "code"] * 40
    assert {p.category for p in every[80:]} == {"code"}
    assert len({p.prompt_id for p in every}) == len(every)
    assert load_domains("math", 2) == load_domain("math", 2)


def test_all_domains_split_the_limit_evenly() -> None:
    prompts = load_all_domains(8)
    assert len(prompts) == 8
    assert Counter(p.category for p in prompts) == {"code": 3, "prose": 3, "math": 2}
    assert len(load_all_domains()) == sum(SIZES.values())
    assert load_all_domains(0) == []


def test_load_prompts_accepts_domain_names() -> None:
    assert load_prompts("math", 2) == load_domain("math", 2)
    assert load_prompts("Prose", 3) == load_domain("prose", 3)
    assert load_prompts("code", 1)[0].category == "code"
    assert load_prompts(ALL_DOMAINS, 6) == load_domains(list(DOMAINS), 2)
    # A path still loads the file with its own categories.
    assert load_prompts(str(DOMAINS["math"]), 1)[0].category == "math_reasoning"


def test_unknown_domain_names_the_known_ones() -> None:
    with pytest.raises(UnknownDomainError, match="unknown domain 'poetry'") as info:
        load_domain("poetry")
    assert "'code', 'prose', 'math'" in str(info.value)
    assert isinstance(info.value, ValueError)
    # Every name is checked before any loading.
    with pytest.raises(UnknownDomainError, match="'maths'"):
        load_domains(["code", "maths"])
    with pytest.raises(UnknownDomainError, match="no domains"):
        load_domains([])
    with pytest.raises(PromptSourceError, match="more than once: math"):
        load_domains(["math", "prose", "math"])
    with pytest.raises(PromptSourceError, match="'prose', 'math' or 'domains'"):
        load_prompts("poetry")


def test_every_prompt_fits_the_embedded_tokenizer() -> None:
    """bench_online keeps the last 512 tokens of a prompt; none of ours may need cutting."""
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    lengths = {p.prompt_id: len(encode(tokenizer, p.text)) for p in load_all_domains()}
    too_long = {k: n for k, n in lengths.items() if n >= 512}
    assert not too_long, too_long
    assert min(lengths.values()) > 0
