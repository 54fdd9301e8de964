"""Reference sequences: a prompt's tokens followed by the response the oracle must reproduce.

The response is the prompt source's own reference where it gives one (and ``use_given`` is on),
else the target's greedy continuation up to a token budget. docs/contract.md numbers positions
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


def left_padded(
    rows: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` right-aligned in one batch: (ids, 2D attention mask, position ids). Each row's
    positions count its own tokens from 0 (cumsum of the mask - 1; pads clamped to 0), so a
    row sees the positions it would alone. Pads are token 0 (any id will do under the mask)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        if row:
            ids[b, width - len(row) :] = torch.tensor(row)
            mask[b, width - len(row) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


@torch.no_grad()
def _greedy_batch(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None
) -> list[list[int]]:
    """One left-padded batch decoded together on one cache: every row takes its argmax each
    step; a row that has emitted EOS keeps being fed (its tokens are dropped) until all rows
    are done or the budget is spent."""
    device = next(model.parameters()).device
    ids, mask, positions = left_padded(prompts, device)
    cache = DynamicCache(config=model.config)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        logits = model(
            ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        token = logits.argmax(-1)
        steps.append(token)
        if eos_id is not None:
            done |= token == eos_id
            if bool(done.all()):
                break
        ids = token.view(-1, 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    out: list[list[int]] = []
    for row in torch.stack(steps, dim=1).tolist():
        end = row.index(eos_id) + 1 if eos_id in row else len(row)
        out.append(row[:end])
    return out


def greedy_continuations(
    model: PreTrainedModel,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    batch_size: int = 16,
) -> list[list[int]]:
    """Greedy continuations of many prompts, ``batch_size`` at a time (prompts of similar
    length share a batch, so little is padding); in the order given. ``batch_size=1`` is
    ``greedy_continuation`` per prompt. A batched row equals its unbatched continuation except
    where float rounding of the padded batch flips a near-tie of the argmax."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if any(not p for p in prompts_ids):
        raise ValueError("every prompt needs at least one token")
    if batch_size == 1:
        return [greedy_continuation(model, p, max_new_tokens, eos_id) for p in prompts_ids]
    order = sorted(range(len(prompts_ids)), key=lambda j: len(prompts_ids[j]))
    out: list[list[int]] = [[] for _ in prompts_ids]
    for start in range(0, len(order), batch_size):
        group = order[start : start + batch_size]
        batch = [prompts_ids[j] for j in group]
        rows = (
            _greedy_batch(model, batch, max_new_tokens, eos_id)
            if len(batch) > 1
            else [greedy_continuation(model, batch[0], max_new_tokens, eos_id)]
        )
        for j, row in zip(group, rows, strict=True):
            out[j] = row
    return out


def build_references(
    prompts: list[Prompt],
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int = 128,
    use_given: bool = False,
    max_prompt_tokens: int = 1024,
    batch_size: int = 16,
) -> list[ReferenceSequence]:
    """Tokenise prompts (keeping the last ``max_prompt_tokens``) and attach their responses;
    greedy ones are decoded ``batch_size`` prompts at a time (1: one by one)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    encoded: list[list[int]] = []
    responses: dict[int, tuple[list[int], str]] = {}
    for j, prompt in enumerate(prompts):
        prompt_ids = encode(tokenizer, prompt.text, keep_last=max_prompt_tokens)
        if not prompt_ids:
            raise ValueError(f"prompt {prompt.prompt_id!r} has no tokens")
        encoded.append(prompt_ids)
        if use_given and prompt.reference:
            responses[j] = (encode(tokenizer, prompt.reference)[:max_new_tokens], "given")
    greedy = [j for j in range(len(prompts)) if j not in responses]
    generated = greedy_continuations(
        target, [encoded[j] for j in greedy], max_new_tokens, tokenizer.eos_token_id, batch_size
    )
    responses.update({j: (g, "greedy") for j, g in zip(greedy, generated, strict=True)})
    refs: list[ReferenceSequence] = []
    for j, prompt in enumerate(prompts):
        response, source = responses[j]
        if not response:
            continue
        refs.append(
            ReferenceSequence(
                seq_id=prompt.prompt_id,
                category=prompt.category,
                source=source,
                prompt_ids=tuple(encoded[j]),
                response_ids=tuple(response),
            )
        )
    return refs
