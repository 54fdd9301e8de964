"""Chat messages to the prompt the model continues: the tokenizer's chat template when it has
one (Hugging Face's apply_chat_template, with the generation prompt that opens the assistant's
turn), else a plain fallback:

    system: You are terse.
    user (alice): Hello
    assistant:

one line per message, "role: content" ("role (name): content" when the message has a name),
then "assistant:" for the model to continue. The rendered text is tokenized as every prompt
is (pipeline.data.prompts.encode: no special tokens added; a template writes its own).
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from pipeline.data.prompts import encode
from serving.errors import RequestError


def _fallback(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        who = f"{m['role']} ({m['name']})" if m.get("name") else m["role"]
        lines.append(f"{who}: {m['content']}\n")
    return "".join(lines) + "assistant:"


def render_chat_text(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text of ``messages`` (dicts with role, content as a string, name if any)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return _fallback(messages)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        # Templates refuse conversations they cannot render (e.g. roles that do not alternate)
        # by raising; the reason is the client's to fix.
        raise RequestError(
            f"messages: the model's chat template refused them: {exc}", "messages"
        ) from None
    if not isinstance(text, str):  # a template renders one string for one conversation
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
    return text


def render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt token ids of ``messages``, ready for the engine."""
    return encode(tokenizer, render_chat_text(tokenizer, messages))
