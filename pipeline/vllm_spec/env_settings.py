"""Settings that travel to vLLM's processes in an environment variable: a JSON object of a
dataclass's fields (vLLM builds our drafter and scheduler from its own config alone)."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any


def fields_from_env(cls: type, name: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The fields ``$name`` sets for ``cls`` ({} when unset), or a ValueError naming the
    variable and what is wrong with it."""
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"${name} is not JSON ({exc}): {text[:80]!r}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"${name} must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"${name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return data
