"""A lossless speculative decoder over HF models with KV caches, with the draft policy as a
plug-in (pipeline.policies).

Each step: the policy proposes candidates with the draft (a chain, or a tree given by parent
indices); the target verifies the last committed token plus every candidate in one forward
(a 4D tree mask for trees); acceptance walks the candidates from the root:

* greedy (temperature 0): follow the child whose token is the target's argmax, then emit the
  argmax as the bonus token; the output equals plain greedy decoding;
* sampling, chain drafted by sampling from q: accept x with probability min(1, p(x)/q(x)),
  else emit a sample of norm(max(p - q, 0)) (speculative sampling);
* sampling, candidates chosen deterministically (a top-b tree): try the children in order,
  accepting x with probability r(x) where r starts as p and loses each rejected token's mass
  (renormalised); if none is accepted emit a sample of r (the multi-candidate rule of
  SpecInfer / EAGLE for deterministic proposals).

Both caches are rolled back to the accepted path. Every step records what was drafted and
verified, the accepted tokens, the unique experts per MoE layer in the verification pass, and
the draft and verification times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.kvcache import crop_to, keep_positions
from pipeline.models import ModelPair
from pipeline.routing import RoutingCapture
from pipeline.timing import timed
from pipeline.treemask import ancestor_matrix, tree_attention_inputs


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Next-token distribution(s) after temperature and top-p (float32)."""
        logits = logits.float()
        if self.greedy:
            return torch.softmax(logits, dim=-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the top token).
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


@dataclass
class Candidates:
    """Draft proposals: node j has token ``tokens[j]`` and parent ``parents[j]`` (-1: the last
    committed token). ``q[j]`` is the distribution node j was *sampled* from (chain sampling);
    None for nodes chosen deterministically (argmax / top-b)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))


class Drafter:
    """The draft model's side of a step: catch up on committed tokens, extend a chain, expand a
    tree level; rolled back to the committed prefix after every step.

    It also keeps the draft's last-layer hidden state of every row it just computed
    (``hidden``): the state that produced a drafted token's distribution is the cheap, already
    paid-for context an expert predictor reads (pipeline.expert_predictor). ``root_context`` is
    that state for the last committed token (the one the verification pass starts with).
    """

    def __init__(self, pair: ModelPair, sampling: SamplingConfig, generator: torch.Generator):
        self.pair = pair
        self.sampling = sampling
        self.generator = generator
        self.cache = DynamicCache(config=pair.draft.config)
        self.committed_len = 0
        self._tree_parents: list[int] = []  # nodes appended to the cache this step
        self.hidden: torch.Tensor | None = None  # [rows, hidden] of the last forward
        self.root_context: torch.Tensor | None = None
        self._last_committed_hidden: torch.Tensor | None = None

    def _forward(self, ids: list[int], **kw) -> torch.Tensor:
        t = torch.tensor([ids], device=self.pair.device)
        out = self.pair.draft(
            t, past_key_values=self.cache, use_cache=True, output_hidden_states=True, **kw
        )
        self.hidden = out.hidden_states[-1][0]
        return out.logits[0]

    def prefill(self, ids: list[int]) -> None:
        """Feed the prompt (all but its last token) before the first step, as the target's
        prefill is, so that no step's draft time includes it."""
        if ids:
            self._forward(ids)
            self._last_committed_hidden = self.hidden[-1]
            self.committed_len = len(ids)  # what end() rolls back to, even with no draft

    def begin(self, committed: list[int]) -> torch.Tensor:
        """Feed committed tokens the cache lacks; the distribution after the last one."""
        pending = committed[self.cache.get_seq_length() :]
        self.committed_len = len(committed)
        self._tree_parents = []
        logits = self._forward(pending)
        # The state after the second-to-last committed token: in this forward when it fed two
        # or more tokens, else the last committed state of the previous step.
        if len(pending) >= 2:
            self.root_context = self.hidden[-2]
        else:
            self.root_context = self._last_committed_hidden
        self._last_committed_hidden = self.hidden[-1]
        return self.sampling.probs(logits[-1])

    def extend(self, token: int) -> torch.Tensor:
        """Chain: append ``token``; the distribution after it."""
        self._tree_parents.append(len(self._tree_parents) - 1)
        return self.sampling.probs(self._forward([token])[-1])

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Tree: append a level of nodes (``parents`` index earlier appended nodes, -1 = root);
        their next-token distributions, one row each."""
        base = self.committed_len
        start = len(self._tree_parents)
        self._tree_parents.extend(parents)
        sees = ancestor_matrix(self._tree_parents)[start:]  # rows: new nodes
        dtype = self.pair.draft.dtype
        mask = torch.zeros(len(tokens), base + len(self._tree_parents), dtype=dtype)
        mask[:, base:] = torch.where(sees, 0.0, torch.finfo(dtype).min)
        depth = sees.sum(dim=1) - 1
        positions = (base + depth).view(1, -1).to(self.pair.device)
        logits = self._forward(
            tokens, attention_mask=mask.view(1, 1, *mask.shape).to(self.pair.device),
            position_ids=positions,
        )  # fmt: skip
        return self.sampling.probs(logits)

    def sample(self, probs: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def end(self) -> None:
        crop_to(self.cache, self.committed_len)


@dataclass(frozen=True)
class StepRecord:
    drafted: int
    verified: int
    accepted: int
    new_tokens: int
    unique_experts: list[int]  # per MoE layer, over the whole verification pass
    t_draft_ms: float
    t_verify_ms: float

    @property
    def u_bar(self) -> float:
        return float(np.mean(self.unique_experts))


@dataclass
class Generation:
    tokens: list[int]
    text: str
    finish_reason: str  # "length", "eos", "stop" (or "cancelled": a stream stopped early)
    steps: list[StepRecord]

    @property
    def mean_accepted(self) -> float:
        return float(np.mean([s.accepted for s in self.steps])) if self.steps else 0.0


@dataclass(frozen=True)
class StepOutcome:
    candidates: Candidates
    accepted: int
    record: StepRecord


class DecodeSession:
    """One generation in progress: both caches, the committed tokens, the step records."""

    def __init__(
        self, pair: ModelPair, prompt_ids: list[int], policy, sampling, seed, repeats: int = 1
    ):
        """``repeats`` > 1 (calibration) runs every draft proposal and verification pass that
        many times, rolling the caches back in between, and records the median times; only
        greedy decoding, whose repeats are identical, allows it."""
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.pair = pair
        self.policy = policy
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(0 if seed is None else seed)
        self.committed = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.target_cache = DynamicCache(config=pair.target.config)
        self.drafter = Drafter(pair, sampling, self.generator)
        with torch.no_grad():
            if len(self.committed) > 1:
                ids = torch.tensor([self.committed[:-1]], device=pair.device)
                pair.target(ids, past_key_values=self.target_cache, use_cache=True)
            self.drafter.prefill(self.committed[:-1])
        self.steps: list[StepRecord] = []
        if repeats > 1 and not sampling.greedy:
            raise ValueError("timing repeats need greedy decoding (sampling would differ)")
        self.repeats = repeats
        policy.reset()

    def _timed_repeats(self, fn, rollback):
        times = []
        for attempt in range(self.repeats):
            if attempt:
                rollback()
            result, t_ms = timed(self.pair.device, fn)
            times.append(t_ms)
        return result, float(np.median(times))

    @torch.no_grad()
    def step(self) -> list[int]:
        """Draft, verify in one target forward, accept, roll back; the new tokens."""
        pair = self.pair

        def propose() -> Candidates:
            try:
                return self.policy.propose(self.drafter, self.committed)
            finally:
                self.drafter.end()

        draft_len = self.drafter.cache.get_seq_length()
        cands, t_draft = self._timed_repeats(
            propose, lambda: crop_to(self.drafter.cache, draft_len)
        )
        base = len(self.committed) - 1
        ids = torch.tensor([[self.committed[-1], *cands.tokens]], device=pair.device)
        kwargs = {}
        if not cands.is_chain:
            parents = [-1] + [p + 1 for p in cands.parents]
            mask, positions = tree_attention_inputs(parents, base, pair.target.dtype, pair.device)
            kwargs = {"attention_mask": mask, "position_ids": positions}

        def verify():
            with RoutingCapture(pair.target, pair.spec) as capture:
                out = pair.target(ids, past_key_values=self.target_cache, use_cache=True, **kwargs)
                return out.logits[0], capture.take(1, ids.shape[1])[0]

        (logits, routing), t_verify = self._timed_repeats(
            verify, lambda: crop_to(self.target_cache, base)
        )
        new, accepted = accept(cands, self.sampling.probs(logits), self.sampling, self.generator)
        keep_positions(self.target_cache, base, [0] + [n + 1 for n in accepted])
        self.committed.extend(new)
        routing_np = routing.cpu().numpy()
        unique = [len(np.unique(routing_np[:, layer])) for layer in range(routing_np.shape[1])]
        record = StepRecord(len(cands), len(cands) + 1, len(accepted), len(new), unique,
                            t_draft, t_verify)  # fmt: skip
        self.steps.append(record)
        self.policy.update(StepOutcome(cands, len(accepted), record))
        return new

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len :]


class SpeculativeEngine:
    def __init__(self, pair: ModelPair):
        self.pair = pair

    def start(
        self, prompt_ids: list[int], policy, sampling=None, seed=None, repeats: int = 1
    ) -> DecodeSession:
        return DecodeSession(
            self.pair, prompt_ids, policy, sampling or SamplingConfig(), seed, repeats
        )

    def stream(
        self,
        prompt_ids: list[int],
        policy,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_at_eos: bool = True,
    ) -> GenerationStream:
        """A generation to run step by step, handing out its text as it grows."""
        return GenerationStream(self, prompt_ids, policy, max_new_tokens, sampling, seed, stop,
                                stop_at_eos)  # fmt: skip

    def generate(self, prompt_ids: list[int], policy, max_new_tokens: int = 64,
                 sampling: SamplingConfig | None = None, seed: int | None = None,
                 stop: list[str] | None = None, stop_at_eos: bool = True,
                 ) -> Generation:  # fmt: skip
        """Decode until max_new_tokens, EOS or a stop string (the text ends before it)."""
        return self.stream(prompt_ids, policy, max_new_tokens, sampling, seed, stop,
                           stop_at_eos).run()  # fmt: skip


class GenerationStream:
    """One generation and how it ends (max tokens, EOS, the first stop string), run by
    iterating ``deltas()`` (text as it grows, for streaming) or by ``run()``; the result is in
    ``result``.

    A delta never holds text the finished generation will not: the last len(longest stop) - 1
    characters are held back (the next step may complete a stop string), as is a trailing
    U+FFFD (a UTF-8 character split across tokens).
    """

    def __init__(self, engine: SpeculativeEngine, prompt_ids: list[int], policy,
                 max_new_tokens: int, sampling: SamplingConfig | None, seed: int | None,
                 stop: list[str] | None, stop_at_eos: bool) -> None:  # fmt: skip
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling or SamplingConfig()
        self.seed = seed
        self.stop = [s for s in (stop or []) if s]
        self.stop_at_eos = stop_at_eos
        self.result: Generation | None = None

    def deltas(self, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Run step by step, yielding non-empty text deltas whose concatenation is the final
        ``result.text``; ``cancelled()`` is polled between steps (finish reason "cancelled")."""
        tok = self.engine.pair.tokenizer
        eos = tok.eos_token_id if (self.stop_at_eos and tok is not None) else None
        holdback = max((len(s) for s in self.stop), default=1) - 1
        emitted = ""
        with torch.no_grad():
            session = self.engine.start(self.prompt_ids, self.policy, self.sampling, self.seed)
            reason = "length"
            while len(session.generated) < self.max_new_tokens:
                if cancelled():
                    reason = "cancelled"
                    break
                new = session.step()
                if eos is not None and eos in new:
                    reason = "eos"
                    break
                if tok is None:
                    continue
                text = tok.decode(session.generated[: self.max_new_tokens])
                if any(s in text for s in self.stop):
                    reason = "stop"
                    break
                safe = text[: len(text) - holdback].rstrip("\ufffd")
                if len(safe) > len(emitted) and safe.startswith(emitted):
                    yield safe[len(emitted) :]
                    emitted = safe
        out = session.generated[: self.max_new_tokens]
        if eos is not None and eos in out:
            out = out[: out.index(eos) + 1]
        text = tok.decode(out) if tok is not None else ""
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, reason = text[: min(cuts)], "stop"
        self.result = Generation(out, text, reason, session.steps)
        if text.startswith(emitted) and len(text) > len(emitted):
            yield text[len(emitted) :]
        # (decode() not prefix-stable would leave the stream unable to take text back; the
        # result still holds the exact final text.)

    def run(self) -> Generation:
        for _ in self.deltas():
            pass
        assert self.result is not None
        return self.result


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.cpu().float(), 1, generator=generator))


def accept(
    cands: Candidates, probs: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """Walk the candidates from the root; returns (new tokens, accepted node indices).

    ``probs[0]`` is the target's distribution after the last committed token, ``probs[j + 1]``
    after candidate node j.
    """
    children: dict[int, list[int]] = {}
    for j, p in enumerate(cands.parents):
        children.setdefault(p, []).append(j)
    node, row = -1, 0
    accepted: list[int] = []
    tokens: list[int] = []
    while True:
        kids = children.get(node, [])
        p = probs[row]
        if sampling.greedy:
            choice = int(p.argmax())
            nxt = next((c for c in kids if cands.tokens[c] == choice), None)
            if nxt is None:
                return [*tokens, choice], accepted
        elif kids and len(kids) == 1 and cands.q[kids[0]] is not None:
            c = kids[0]
            x, q = cands.tokens[c], cands.q[c].to(p.device)
            if float(torch.rand((), generator=generator)) < min(1.0, float(p[x] / q[x])):
                nxt = c
            else:
                residual = (p - q).clamp_min(0)
                residual = residual / residual.sum() if residual.sum() > 0 else p
                return [*tokens, _draw(residual, generator)], accepted
        else:
            residual = p.clone()
            nxt = None
            for c in kids:
                x = cands.tokens[c]
                if float(torch.rand((), generator=generator)) < float(residual[x]):
                    nxt = c
                    break
                residual[x] = 0.0
                total = residual.sum()
                if total <= 0:
                    break
                residual = residual / total
            if nxt is None:
                return [*tokens, _draw(residual if residual.sum() > 0 else p, generator)], accepted
        accepted.append(nxt)
        tokens.append(cands.tokens[nxt])
        node, row = nxt, nxt + 1
