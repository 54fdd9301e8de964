"""vLLM's ``draft_model`` drafter with the acceptance stop (pipeline.vllm_spec.acceptance_stop),
over the catch-up drafter (pipeline.vllm_spec.catch_up_draft): the stop follows each request's
text from the step's inputs as vLLM hands them over, before a catch-up extends them, and
judges every drafted position where vLLM samples it."""

from __future__ import annotations

import torch

from pipeline.vllm_spec.acceptance_stop import StopDrafting, acceptance_stop_for
from pipeline.vllm_spec.step_rows import step_rows


class AcceptanceStopDrafter:
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        # Where the scheduler's settings ask for it (stop_below > 0); else None.
        self.acceptance_stop = acceptance_stop_for(vllm_config)
        self._judging = False  # this step's chains are judged as they are drafted

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample,
        common_attn_metadata,
        sampling_metadata,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        stop, k = self.acceptance_stop, num_speculative_tokens
        self._judging = stop is not None and k > 0 and bool(sampling_metadata.all_greedy)
        batch = common_attn_metadata.batch_size()
        if self._judging:
            inputs = self.runner.input_batch
            starts, lens = step_rows(common_attn_metadata)
            rejected = kwargs.get("num_rejected_tokens_gpu")
            stop.begin(
                list(inputs.req_ids[:batch]),
                inputs.token_ids_cpu,
                inputs.num_tokens_no_spec,
                starts,
                lens,
                target_token_ids.tolist(),
                next_token_ids.tolist(),
                rejected.tolist() if rejected is not None else None,
                k,
            )
            if len(stop.texts) > 4 * max(1, self.max_batch_size):
                stop.forget(set(self.runner.requests))
        try:
            out = super().propose(
                k,
                target_token_ids,
                target_positions,
                target_hidden_states,
                next_token_ids,
                token_indices_to_sample,
                common_attn_metadata,
                sampling_metadata,
                *args,
                **kwargs,
            )
        except StopDrafting:  # every row stopped: the loop's later forwards do not run
            self._last_draft_probs = None
            return stop.proposals(batch, target_token_ids.device)
        finally:
            judged, self._judging = self._judging, False
        return stop.finish(out) if judged else out

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if not self._judging:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        # Greedy: the argmax, as vLLM's own greedy sample; the stop reads its logits.
        logits = self.model.compute_logits(hidden_states)
        tokens = logits.argmax(dim=-1)
        self.acceptance_stop.judge(logits, hidden_states, tokens)
        return tokens, None
