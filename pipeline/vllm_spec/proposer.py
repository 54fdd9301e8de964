"""specbound's cost-aware draft length as a vLLM proposer (``method: custom_class``).

    LLM(model="models/target", dtype="float32", enforce_eager=True, speculative_config={
        "method": "custom_class", "num_speculative_tokens": 6,
        "model": "pipeline.vllm_spec.proposer.CostAwareProposer"})

vLLM 0.32 builds it as ``CostAwareProposer(vllm_config)``, calls ``load_model(target)`` once
and ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` after every engine step:
one list of draft tokens per batch row, 0 to K long (pipeline.vllm_spec.contract). Each step:

1. every row's draft state is found from its tokens (pipeline.vllm_spec.rows); the tokens its
   last proposal got accepted update its recent acceptance and its logit correction;
2. before any draft forward, the batch's plan at each row's expected acceptance (the
   acceptance model's spread around recent acceptance) says whether a look pays: if no row
   would draft, the step proposes nothing and runs no forward (every ``probe_every`` plain
   steps a row drafts one token anyway, so its acceptance keeps being measured);
3. one packed draft forward catches the drafting rows up and gives each its next distribution;
   the acceptance model (draft confidence, entropy, margin, the context match, the draft's
   hidden state, recent acceptance) gives each row's acceptance by chain depth, and the plan
   (pipeline.decode.batch_economy.plan_lengths, priced with vLLM's measured step costs:
   pipeline.vllm_spec.step_cost) chooses every row's length for the batch's tokens per ms:
   one more position costs the experts no other position of the step brings;
4. the chains are drafted in packed rounds, the draft's argmax at each position.

vLLM verifies token ids as a point mass (its rejection sampler takes the draft probability as
1): a proposed x is accepted with the target's probability of x, so the most likely token is
proposed at any temperature, and lossless sampling is vLLM's own.
"""

from __future__ import annotations

import atexit
import json
import random
import time
from typing import Any

import numpy as np
import torch

from pipeline.acceptance.features import MAX_MATCH, position_stats
from pipeline.decode.batch_economy import plan_lengths
from pipeline.vllm_spec import config as proposer_config
from pipeline.vllm_spec.draft import PackedDraft
from pipeline.vllm_spec.router_hook import RouterUnion
from pipeline.vllm_spec.rows import DraftState, StateTable
from pipeline.vllm_spec.stats import ENV as STATS_ENV
from pipeline.vllm_spec.stats import StatsFile

MAX_OFFSET = 3.0  # the online logit correction stays within this
# A new request starts from what the engine's recent requests showed (recent acceptance and
# the logit correction, slow averages over every judged token), not from the offline prior:
# the same engine serves one workload, and what it accepts there (at T > 0 on vLLM's CPU
# build: almost nothing) is known before a new request has a single outcome of its own.
ENGINE_DECAY = 0.98
FLUSH_EVERY = 20  # step records written to the record file in batches (calibration)


class CostAwareProposer:
    def __init__(self, vllm_config: Any) -> None:
        import os

        try:
            from vllm import __version__ as vllm_version
        except ImportError:  # built outside vLLM (tests of the proposer's own logic)
            vllm_version = None
        spec = vllm_config.speculative_config
        model_config = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(model_config.max_model_len)
        self.config = proposer_config.ProposerConfig.from_env()
        self.target_path = model_config.model
        dtype = str(model_config.dtype).replace("torch.", "")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.artifacts = proposer_config.check(
            self.config, model_config.model, dtype, device, vllm_version
        )
        self.draft = PackedDraft(
            self.artifacts.draft, device, rows=max(4, vllm_config.scheduler_config.max_num_seqs)
        )
        self.states = StateTable(self.draft.acquire, self.draft.release)
        self.cost = self.artifacts.cost
        acc = self.artifacts.acceptance
        self.mode = acc.mode(True) if acc is not None else None  # point mass: the greedy rule
        self.decay = acc.decay if acc is not None else 0.8
        self.stats = StatsFile(os.environ.get(STATS_ENV) or None)
        self.rng = random.Random(self.config.seed)
        self.router: RouterUnion | None = None
        self._engine_recent: float | None = None
        self._engine_offset = 0.0
        self._last_end: float | None = None
        self._pending: dict[str, Any] | None = None  # what the next step's pass verifies
        self._records: list[dict[str, Any]] = []

    # -- vLLM's contract ---------------------------------------------------------------------
    def load_model(self, target: torch.nn.Module | None = None, *args, **kwargs) -> None:
        """vLLM hands over its target model; a calibration run hooks its MoE gates to see the
        experts every step's pass routes to."""
        if self.config.record and target is not None:
            self.router = RouterUnion.attach(target, self.target_path)
            atexit.register(self.flush)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        start = time.perf_counter()
        self._record_step(start)
        self.draft.forward_s = 0.0
        rounds_before = self.draft.forwards
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = [
            i
            for i, ids in enumerate(sampled_token_ids)
            if ids and int(num_tokens_no_spec[i]) + 1 < self.max_model_len
        ]
        if rows:
            texts = [
                np.asarray(token_ids_cpu[i, : int(num_tokens_no_spec[i])], dtype=np.int64)
                for i in rows
            ]
            matched = self.states.match(texts)
            self._observe(matched, texts)
            caps = [min(self.k, self.max_model_len - len(t) - 1) for t in texts]
            chains = self._draft(matched, texts, caps)
            for i, chain in zip(rows, chains, strict=True):
                out[i] = chain
        drafted = sum(len(c) for c in out)
        end = time.perf_counter()
        if self._last_end is not None:
            self.stats.add(step_s=end - self._last_end, steps_timed=1)
        self.stats.add(
            calls=1,
            propose_s=end - start,
            draft_s=self.draft.forward_s,
            decide_s=end - start - self.draft.forward_s,
            drafted=drafted,
            rows=len(rows),
            draft_rounds=self.draft.forwards - rounds_before,
            plain_steps=float(self.draft.forwards == rounds_before),
        )
        self._pending = {
            "rows": len(rows),
            "positions": len(rows) + drafted,
            "attended": sum((1 + len(out[i])) * int(num_tokens_no_spec[i]) for i in rows),
            "propose_ms": (end - start) * 1e3,
            "draft_ms": self.draft.forward_s * 1e3,
            "draft_forwards": self.draft.records,
        }
        self.draft.records = []
        self._last_end = end
        return out

    # -- one step ----------------------------------------------------------------------------
    def _observe(self, matched: list[tuple[DraftState, int]], texts: list[np.ndarray]) -> None:
        """What verification did with each row's last proposal (from the row's text)."""
        verified = accepted_total = 0
        for (state, keep), text in zip(matched, texts, strict=True):
            if keep < len(state.index.tokens):
                # Not the text this state committed: another request sharing its prefix, or
                # this one recomputed. Its cache prefix is kept; what was learned is not.
                state.index = type(state.index)()
                state.recent, state.offset, state.plain_run = None, None, 0
                state.proposed, state.predicted = [], []
            if state.proposed and keep >= state.proposed_at:
                accepted = state.outcome(text)
                if accepted is not None:
                    judged = min(len(state.proposed), accepted + 1)
                    recent, offset = self._recent(state), self._offset(state)
                    engine = recent if self._engine_recent is None else self._engine_recent
                    for j in range(judged):
                        hit = float(j < accepted)
                        recent = self.decay * recent + (1 - self.decay) * hit
                        engine = ENGINE_DECAY * engine + (1 - ENGINE_DECAY) * hit
                        if j < len(state.predicted):
                            offset += self.config.adapt * (hit - state.predicted[j])
                    state.offset = max(-MAX_OFFSET, min(MAX_OFFSET, offset))
                    state.recent, self._engine_recent = recent, engine
                    self._engine_offset = (
                        ENGINE_DECAY * self._engine_offset + (1 - ENGINE_DECAY) * state.offset
                    )
                    verified += 1
                    accepted_total += accepted
            state.proposed, state.predicted = [], []
        self.stats.add(verified=verified, accepted=accepted_total)

    def _recent(self, state: DraftState) -> float:
        if state.recent is not None:
            return state.recent
        if self._engine_recent is not None:
            return self._engine_recent
        return self.mode.prior if self.mode is not None else 0.5

    def _offset(self, state: DraftState) -> float:
        return self._engine_offset if state.offset is None else state.offset

    def _lengths_before_look(self, matched, texts, caps) -> list[int]:
        """Which rows look at their next distribution: those the plan at expected acceptance
        gives a chain, and those due a probe (design "policy"); every row otherwise."""
        if self.config.design == "fixed":
            return caps
        if self.config.design == "random":
            return [self.rng.randint(0, cap) for cap in caps]
        assert self.mode is not None and self.cost is not None
        accs = []
        for (state, _), cap in zip(matched, caps, strict=True):
            spread = self.mode.spread_around(self._recent(state))
            accs.append([sum(spread) / len(spread)] * cap)
        ks, _ = plan_lengths(self.cost, accs, [len(t) for t in texts], self.k)
        probe = [state.plain_run >= self.config.probe_every for state, _ in matched]
        return [max(k, int(p and cap > 0)) for k, p, cap in zip(ks, probe, caps, strict=True)]

    def _draft(self, matched, texts, caps) -> list[list[int]]:
        looks = self._lengths_before_look(matched, texts, caps)
        chains: list[list[int]] = [[] for _ in texts]
        active = [r for r, k in enumerate(looks) if k > 0]
        for r, k in enumerate(looks):
            if k == 0:
                matched[r][0].plain_run += 1
        if not active:
            return chains
        parts = [self._catch_up(*matched[r], texts[r]) for r in active]
        logits, hidden = self.draft.forward(parts)
        tops = logits.argmax(-1).tolist()
        ks = [looks[r] for r in active]
        if self.config.design == "policy":
            ks = self._plan(matched, texts, caps, active, logits, hidden)
        for r, k, top in zip(active, ks, tops, strict=True):
            if k > 0:
                chains[r].append(top)
        for depth in range(2, max(ks, default=0) + 1):
            going = [(i, r) for i, r in enumerate(active) if ks[i] >= depth]
            logits, _ = self.draft.forward(
                [(matched[r][0].slot, [chains[r][-1]]) for _, r in going]
            )
            for (_, r), top in zip(going, logits.argmax(-1).tolist(), strict=True):
                chains[r].append(top)
        for r in active:
            state = matched[r][0]
            state.proposed, state.proposed_at = chains[r], len(texts[r])
            state.plain_run = 0 if chains[r] else state.plain_run + 1
            state.cached = np.concatenate([texts[r], np.asarray(chains[r][:-1], dtype=np.int64)])
            state.predicted = state.predicted[: len(chains[r])]
        return chains

    def _catch_up(self, state: DraftState, keep: int, text: np.ndarray) -> tuple[int, list[int]]:
        """Cut the state's cache to what its text still shares, and the tokens to feed after
        it (at least the last one: its distribution is the next token's)."""
        keep = min(keep, len(text) - 1)
        self.draft.cut(state.slot, keep)
        state.index.extend(text[len(state.index.tokens) :].tolist())
        return state.slot, text[keep:].tolist()

    def _plan(self, matched, texts, caps, active, logits, hidden) -> list[int]:
        """Each looking row's acceptance by depth from its distribution, then the batch's
        plan over every row (the others verify one position each)."""
        assert self.mode is not None and self.cost is not None
        probs = torch.softmax(logits, dim=-1)
        accs: list[list[float]] = [[] for _ in texts]
        for i, r in enumerate(active):
            state = matched[r][0]
            tail = texts[r][-(MAX_MATCH - 1) :].tolist()
            stats = position_stats(probs[i], state.index, tail)
            a_now, later = self.mode.chain_view(
                stats, self._recent(state), hidden[i], caps[r] - 1, self.decay, self._offset(state)
            )
            accs[r] = [a_now, *later][: caps[r]]
            state.predicted = accs[r]
        ks, _ = plan_lengths(self.cost, accs, [len(t) for t in texts], self.k, sunk_rounds=1)
        probe = [matched[r][0].plain_run >= self.config.probe_every for r in active]
        return [max(ks[r], int(p)) for r, p in zip(active, probe, strict=True)]

    # -- calibration records -----------------------------------------------------------------
    def _record_step(self, now: float) -> None:
        """The step that just ran verified the previous call's proposals: its time, and (in a
        calibration run) the positions and experts its pass routed."""
        if self._last_end is None or not self.config.record or self._pending is None:
            return
        record = dict(self._pending, step_ms=(now - self._last_end) * 1e3)
        if self.router is not None:
            positions, union = self.router.take()
            record.update(hook_positions=positions, union=union)
        self._records.append(record)
        if len(self._records) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._records or not self.config.record:
            return
        with open(self.config.path(self.config.record), "a") as f:
            for rec in self._records:
                f.write(json.dumps(rec) + "\n")
        self._records = []
