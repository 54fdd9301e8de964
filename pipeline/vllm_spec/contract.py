"""What vLLM 0.32 asks of a ``custom_class`` drafter, vLLM's "proposer" (read from
vllm/v1/spec_decode and vllm/v1/worker/gpu_model_runner.py), in one place.

* Built as ``Class(vllm_config)`` in the worker process, before the target is loaded;
  ``speculative_config.num_speculative_tokens`` is K, the longest proposal.
* ``load_model(target_model)`` once the target is loaded (optional for vLLM; the calibration
  drafter hooks the target's MoE gates there).
* ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)`` after
  every engine step, for every row of the persistent batch: ``sampled_token_ids[i]`` the
  tokens row i committed this step (empty while its prompt is still being prefilled),
  ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` its whole committed text (prompt and output),
  nothing else: no request ids, no sampling parameters, no hidden states, no routing.
  Returns one list per row, 0 to K token ids (empty: no speculation for that row).
* Async scheduling is off with it; vLLM verifies each proposal as a point mass (draft
  probability 1): at T > 0 token x is accepted with the target's probability of x.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class CustomClassDrafter(Protocol):
    def load_model(self, *args: Any, **kwargs: Any) -> None: ...

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]: ...
