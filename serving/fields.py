"""Checks of request fields whose items each need their own error: a prompt list, stop
sequences, a message's content parts. A problem is a FieldError carrying the item's path below
the field, so the client reads "prompt[1]: must not be empty", not just "prompt". The
request models (serving.protocol) call these as pydantic "plain" validators: pydantic's own
union handling would report every branch of ``str | list[...]`` and tag the location with
type names."""

from __future__ import annotations

from typing import Any

from pipeline.decode.policies.knobs import describe

Path = tuple[int | str, ...]


class FieldError(ValueError):
    """A problem with one item inside a field: ``path`` continues the field's location
    ((1,) under "prompt" is "prompt[1]")."""

    def __init__(self, path: Path, message: str):
        super().__init__(message)
        self.path = path


def param_name(loc: tuple) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or None


def check_text(value: str, path: Path = (), *, empty_ok: bool = False) -> str:
    if not value and not empty_ok:
        raise FieldError(path, "must not be empty")
    try:  # JSON may carry lone surrogates ("\ud800"), which no tokenizer can take
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(path, f"contains an unpaired surrogate at index {exc.start}") from None
    return value


def _kind(value: Any) -> type | None:
    if isinstance(value, bool):  # a bool is an int to Python, never a token id to a client
        return None
    return next((t for t in (str, int, list) if isinstance(value, t)), None)


_ITEM = {str: "a string", int: "a token id (integer)", list: "a list of token ids"}


def _token_ids(value: list, path: Path) -> list[int]:
    if not value:
        raise FieldError(path, "must not be empty")
    for j, tok in enumerate(value):
        if _kind(tok) is not int:
            raise FieldError((*path, j), f"expected a token id (integer), got {describe(tok)}")
        if tok < 0:
            raise FieldError((*path, j), f"token ids are >= 0, got {tok}")
    return value


def check_prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """One prompt (a string or a list of token ids) or a list of them, all of one kind, as
    OpenAI takes them. Token ids are checked against the vocabulary later (it needs the model)."""
    if isinstance(value, str):
        return check_text(value)
    if not isinstance(value, list):
        raise FieldError(
            (),
            "expected a string, a list of strings, a list of token ids or a "
            f"list of lists of token ids, got {describe(value)}",
        )
    if not value:
        raise FieldError((), "must not be empty")
    kind = _kind(value[0])
    if kind is None:
        raise FieldError(
            (0,),
            "expected a string, a token id (integer) or a list of token "
            f"ids, got {describe(value[0])}",
        )
    if kind is int:
        return _token_ids(value, ())
    for i, item in enumerate(value):
        if _kind(item) is not kind:
            raise FieldError(
                (i,),
                f"expected {_ITEM[kind]} like prompt[0] (all prompts of one "
                f"kind), got {describe(item)}",
            )
        if kind is str:
            check_text(item, (i,))
        else:
            _token_ids(item, (i,))
    return value


def check_stop(value: Any, limit: int) -> list[str] | None:
    """None, or the stop sequences as a list (at most ``limit``; "" is allowed and ignored)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [check_text(value, empty_ok=True)]
    if not isinstance(value, list):
        raise FieldError((), f"expected a string or a list of strings, got {describe(value)}")
    if len(value) > limit:
        raise FieldError((), f"at most {limit} stop sequences, got {len(value)}")
    for i, stop in enumerate(value):
        if not isinstance(stop, str):
            raise FieldError((i,), f"expected a string, got {describe(stop)}")
        check_text(stop, (i,), empty_ok=True)
    return value


def check_content(value: Any) -> str:
    """A chat message's content: a string, or a non-empty list of ``{"type": "text", "text":
    str}`` parts (other part types need a multimodal model), joined with newlines."""
    if isinstance(value, str):
        return check_text(value, empty_ok=True)
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else describe(value)
        raise FieldError((), f"expected a string or a list of text parts, got {got}")
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise FieldError((i,), f"expected a content part object, got {describe(part)}")
        if part.get("type") != "text":
            got = f"got {part['type']!r}" if "type" in part else "'type' is missing"
            raise FieldError((i, "type"), f"only 'text' parts are supported here; {got}")
        if extra := sorted(set(part) - {"type", "text"}):
            raise FieldError((i, extra[0]), "unsupported field in a text part")
        if not isinstance(part.get("text"), str):
            got = describe(part["text"]) if "text" in part else "nothing"
            raise FieldError((i, "text"), f"expected a string, got {got}")
        texts.append(check_text(part["text"], (i, "text"), empty_ok=True))
    return "\n".join(texts)
