"""A correct CPU stand-in for vLLM 0.32's ``expand_kernel`` (installed by the plugin).

vLLM's CPU build replaces the rejection sampler's Triton kernels with C++ ones
(``vllm/platforms/cpu.py`` ``register_triton_kernel_overrides``). Its wrapper of
``expand_kernel`` (``vllm/utils/cpu_triton_utils.py`` ``_expand_kernel_impl``) converts the
output and the input to int64 copies, lets the C++ kernel fill the copy and never copies it
back. The rejection sampler expands each request's temperature, top-k and top-p to its draft
tokens with it (``expand_batch_to_tokens``), so at T > 0 the target's logits are divided by
uninitialised memory: its probabilities reach the rejection test near uniform (1 / vocab),
zero or NaN, and almost every draft token is rejected. A float temperature would be truncated
to an integer even if it were copied back. Greedy requests never use it.

This replacement does what the Triton kernel does, in torch, for any dtype.
"""

from __future__ import annotations

import torch


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 (the Triton kernel's argument name)
) -> None:
    """``output[t] = input_val[r]`` for every token t of request r (``cu_num_tokens``: the
    cumulative token counts), with ``replace_from`` values written as ``replace_to``."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = values.repeat_interleave(counts).to(output.dtype)


def install() -> None:
    """Put the fixed kernel where vLLM's CPU platform reads its overrides from (before the
    worker registers them: general plugins load first, ``worker_base.init_worker``)."""
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
