"""A KV cache shared by many sequences, each in its own block of slots, for packed forwards.

Continuous batching feeds several sequences' new tokens to one forward as ONE packed row
(batch 1, no padding): an MoE verification pass then routes exactly the real tokens, so the
experts it loads are the union over the requests' positions, nothing else. Sequence ``r``
owns slots ``[r * capacity, (r + 1) * capacity)``; its first ``length[r]`` slots are its
cached context. A forward writes every new token to the slot the plan names (the sequence's
next free slots) and attends through a 4D additive mask that shows each token its own
sequence's context and the new tokens it may see. Rolling a sequence back is setting its
length: nothing is copied, and no other sequence is touched.

The whole ``[N, rows * capacity]`` mask is built only if read (LazyMask): the segmented SDPA
attends each sequence to its own block by that block's part of the mask, kept apart.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_map_only  # torch's own way to map a subclass's args
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# The slot cache whose plan the packed forward running now attends by.
_ACTIVE: ContextVar[SlotCache | None] = ContextVar("slot_cache", default=None)
SEGMENTED = "specbound_slot_sdpa"


def _segmented_sdpa(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """SDPA per sequence of a packed forward: each sequence's queries against its own block
    only, so the work is sum(n_r * length_r), not every query against every block (what the
    full mask would cost: the same result, the hidden keys weighing exactly 0). Each block's
    mask comes from the plan, so the full one is never built here."""
    cache = _ACTIVE.get()
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    parts = [
        sdpa_attention_forward(
            module, query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], mask, **kwargs
        )[0]
        for (q0, q1, k0, k1), mask in zip(cache.segments, cache.segment_masks(), strict=True)
    ]
    return torch.cat(parts, dim=1), None


AttentionInterface.register(SEGMENTED, _segmented_sdpa)


@contextmanager
def segmented_attention(model: nn.Module, cache: SlotCache) -> Iterator[None]:
    """Within: ``model`` (an SDPA model) attends per sequence of ``cache``'s current plan;
    any other attention implementation keeps the full mask (correct, slower)."""
    config = model.config
    base = config._attn_implementation
    if base != "sdpa":
        yield
        return
    token = _ACTIVE.set(cache)
    config._attn_implementation = SEGMENTED
    try:
        yield
    finally:
        config._attn_implementation = base
        _ACTIVE.reset(token)


def _visibility(vis: torch.Tensor | None, n: int, length: int) -> torch.Tensor:
    """A part's ``[n, length + n]`` bool visibility (None: causal)."""
    if vis is None:
        vis = torch.ones(n, length + n, dtype=torch.bool)
        vis[:, length:] = torch.tril(vis[:, length:])
    return vis


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, dtype-min where hidden."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)


Segment = tuple[int, int, int, int]  # query start, query end, key start, key end
Part = tuple[torch.Tensor | None, int]  # a part's visibility (None: causal), cached length


def _dense_mask(segments: list[Segment], parts: list[Part], width: int, dtype, device):
    """The plan's whole additive mask ``[1, 1, N, width]``: each part's visibility in its
    block, everything else hidden."""
    total = segments[-1][1]
    visible = torch.zeros(total, width, dtype=torch.bool)
    for (q0, q1, k0, k1), (vis, length) in zip(segments, parts, strict=True):
        visible[q0:q1, k0:k1] = _visibility(vis, q1 - q0, length)
    return _additive(visible, dtype).view(1, 1, total, width).to(device)


def _segment_masks(segments: list[Segment], parts: list[Part], dtype, device):
    """Each part's mask over its own block, ``[1, 1, n, length + n]`` (the whole mask's blocks
    on its diagonal, the same values), moved to the device in one copy."""
    blocks = [
        _additive(_visibility(vis, q1 - q0, length), dtype)
        for (q0, q1, _, _), (vis, length) in zip(segments, parts, strict=True)
    ]
    flat = torch.cat([b.flatten() for b in blocks]).to(device)
    pieces = flat.split([b.numel() for b in blocks])
    return [p.view(1, 1, *b.shape) for p, b in zip(pieces, blocks, strict=True)]


# Reads of a mask's metadata, which need no values (transformers checks the mask's rank).
_METADATA = {torch.Tensor.dim, torch.Tensor.size}
_METADATA |= {getattr(torch.Tensor, a).__get__ for a in ("shape", "ndim", "dtype", "device")}


class LazyMask(torch.Tensor):
    """A plan's additive 4D mask holding no values until something reads them: then it is
    built once (``dense()``) and every operation runs on that tensor, so a reader sees exactly
    the mask the plan describes. Its shape, dtype and device are set from the start."""

    @staticmethod
    def __new__(cls, build: Callable[[], torch.Tensor], shape, dtype, device) -> LazyMask:
        mask = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        mask._build, mask._dense = build, None
        return mask

    @property
    def built(self) -> bool:
        return self._dense is not None

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self._build()
        return self._dense

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        args, kwargs = tree_map_only(LazyMask, LazyMask.dense, (args, kwargs or {}))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Only operators reached without __torch_function__ (from C++) get here.
        args, kwargs = tree_map_only(LazyMask, LazyMask.dense, (args, kwargs or {}))
        return func(*args, **kwargs)


class _SlotLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(self._shape(key_states))
        self.values = value_states.new_zeros(self._shape(value_states))
        self.is_initialized = True

    def _shape(self, states: torch.Tensor) -> tuple[int, ...]:
        return (1, states.shape[1], self.owner.rows * self.owner.capacity, states.shape[-1])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = self.owner.write_index
        if index is None or index.numel() != key_states.shape[-2]:
            raise RuntimeError("a SlotCache forward needs a write plan for every new token")
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        width = self.owner.width
        return self.keys[:, :, :width], self.values[:, :, :width]

    def regrow(self, rows: int, capacity: int) -> None:
        """Move every sequence's block to the new layout (more rows, or longer blocks)."""
        if not self.is_initialized:
            return
        old_rows, old_cap = self.owner.rows, self.owner.capacity
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((1, old.shape[1], rows * capacity, old.shape[-1]))
            keep = min(old_cap, capacity)
            view_old = old.view(1, old.shape[1], old_rows, old_cap, old.shape[-1])
            view_new = new.view(1, old.shape[1], rows, capacity, old.shape[-1])
            view_new[:, :, :old_rows, :keep] = view_old[:, :, :, :keep]
            setattr(self, name, new)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return 0  # positions come from position_ids; no single sequence length exists

    def get_max_length(self) -> int:
        return self.owner.rows * self.owner.capacity


class SlotCache(Cache):
    """Blocks of slots for up to ``rows`` sequences of up to ``capacity`` positions each; both
    grow on demand (a copy of the whole cache, rare: the row count and the block length only
    ever grow). ``length[r]`` is sequence r's cached context."""

    def __init__(self, num_layers: int, rows: int = 4, capacity: int = 256) -> None:
        self.rows, self.capacity = rows, capacity
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])
        self.length = [0] * rows
        self.free = list(range(rows))
        self.write_index: torch.Tensor | None = None
        self.segments: list[Segment] = []
        self.width = 0
        # The plan's mask of each part over its own block (_segment_masks), built once if used.
        self.segment_masks: Callable[[], list[torch.Tensor]] = list

    # --- sequences ------------------------------------------------------------------------

    def acquire(self) -> int:
        """A free block for a new sequence (its length 0)."""
        if not self.free:
            self._regrow(self.rows * 2, self.capacity)
        row = self.free.pop(0)
        self.length[row] = 0
        return row

    def release(self, row: int) -> None:
        self.length[row] = 0
        self.free.append(row)
        self.free.sort()

    def reserve(self, row: int, length: int) -> None:
        """Make room for sequence ``row`` to reach ``length`` positions."""
        if length > self.capacity:
            cap = self.capacity
            while cap < length:
                cap *= 2
            self._regrow(self.rows, cap)

    def _regrow(self, rows: int, capacity: int) -> None:
        for layer in self.layers:
            layer.regrow(rows, capacity)
        self.length += [0] * (rows - self.rows)
        self.free += list(range(self.rows, rows))
        self.rows, self.capacity = rows, capacity

    def keep(self, row: int, base: int, extra: list[int]) -> None:
        """Keep the first ``base`` positions of sequence ``row`` and then the positions
        ``base + j`` for j in ``extra`` (an accepted tree path): a copy within that row's block
        only, none at all for a chain."""
        if extra != list(range(len(extra))):
            start = row * self.capacity
            src = torch.tensor([start + base + j for j in extra])
            dst = torch.arange(start + base, start + base + len(extra))
            for layer in self.layers:
                if layer.is_initialized:
                    for t in (layer.keys, layer.values):
                        t[:, :, dst.to(t.device)] = t[:, :, src.to(t.device)]
        self.length[row] = base + len(extra)

    # --- a packed forward -----------------------------------------------------------------

    def plan(
        self,
        parts: list[tuple[int, int, torch.Tensor | None]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Set up one packed forward: ``parts`` are (row, n new tokens, visibility), the
        visibility a ``[n, length + n]`` bool matrix over the row's cached positions and its new
        tokens (None: causal, every cached position and the new tokens before it). The new
        tokens go to the row's next n slots; returns the additive 4D mask ``[1, 1, N, width]``
        (0 visible, dtype-min hidden), a LazyMask built only if read. The row lengths advance
        by n."""
        for row, n, vis in parts:
            length = self.length[row]
            if vis is not None and tuple(vis.shape) != (n, length + n):
                raise ValueError(f"visibility {tuple(vis.shape)} for {n} tokens after {length}")
            self.reserve(row, length + n)
        width = (max(row for row, _, _ in parts) + 1) * self.capacity
        index, segments, kept = [], [], []
        q = 0
        for row, n, vis in parts:
            start, length = row * self.capacity, self.length[row]
            index.extend(range(start + length, start + length + n))
            segments.append((q, q + n, start, start + length + n))
            kept.append((vis, length))
            self.length[row] = length + n
            q += n
        self.write_index = torch.tensor(index, device=device)
        self.segments, self.width = segments, width
        self.segment_masks = functools.cache(partial(_segment_masks, segments, kept, dtype, device))
        build = partial(_dense_mask, segments, kept, width, dtype, device)
        return LazyMask(build, (1, 1, q, width), dtype, device)
