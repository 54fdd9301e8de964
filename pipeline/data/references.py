"""Reference sequences: a prompt's tokens followed by the response the oracle must reproduce.

The response is the prompt source's own reference where it gives one (and ``use_given`` is on),
else the target's greedy continuation up to a token budget. DESIGN section 3 numbers positions
from the prompt's last token ``x_0``; ``tokens`` below holds ``x_0 .. x_N`` contiguously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from pipeline.data.prompts import Prompt, encode


@dataclass(frozen=True)
class ReferenceSequence:
    seq_id: str
    category: str
    source: str  # "given" or "greedy"
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_tokens(self) -> int:
        """N: the number of response tokens (states 0..N)."""
        return len(self.response_ids)

    @property
    def all_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.response_ids


@torch.no_grad()
def greedy_continuation(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None
) -> list[int]:
    """Plain autoregressive greedy decoding with a KV cache (the target's own text)."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        if token == eos_id:
            break
        ids = torch.tensor([[token]], device=device)
    return out


def build_references(
    prompts: list[Prompt],
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int = 128,
    use_given: bool = False,
    max_prompt_tokens: int = 1024,
) -> list[ReferenceSequence]:
    """Tokenise prompts (keeping the last ``max_prompt_tokens``) and attach their responses."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    refs: list[ReferenceSequence] = []
    for prompt in prompts:
        prompt_ids = encode(tokenizer, prompt.text, keep_last=max_prompt_tokens)
        if not prompt_ids:
            raise ValueError(f"prompt {prompt.prompt_id!r} has no tokens")
        if use_given and prompt.reference:
            response = encode(tokenizer, prompt.reference)[:max_new_tokens]
            source = "given"
        else:
            response = greedy_continuation(
                target, prompt_ids, max_new_tokens, tokenizer.eos_token_id
            )
            source = "greedy"
        if not response:
            continue
        refs.append(
            ReferenceSequence(
                seq_id=prompt.prompt_id,
                category=prompt.category,
                source=source,
                prompt_ids=tuple(prompt_ids),
                response_ids=tuple(response),
            )
        )
    return refs
