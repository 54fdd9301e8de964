"""Where `throughput`'s decision time goes inside a real decode (the EAGLE-3 head, 24 prompts x
64 tokens, two passes, T = 0): its propose, section by section, timed in place. The sections
follow pipeline/decode/policies/throughput.py's propose line for line; only the timers are
added. Run from the repository root:

    PYTHONPATH=.:docs/results/repeat_outcomes_2026-12-04 python \\
        docs/results/heap_and_prices_2026-12-04/decision_sections.py [ARTIFACTS [DOMAINS]]

ARTIFACTS: models/eagle3-head (the default) or models (the 1-layer pair); DOMAINS:
comma-separated (default code,prose,math). "Head forwards" are the draft's, whichever the draft.

(The evening_2026-12-04 copy, updated as propose was: the statistics read the logits, the
repeat lookup starts from the context match; and the decodes run against a frozen heap,
as the benches' now do. From 2026-12-05 it reads a position as propose does, with one compiled
call where a C compiler exists; SPECBOUND_NATIVE=0 gives the tensor calls its earlier outputs
were timed with, then labelled "position_view".)
"""

import sys
import time
from collections import defaultdict

import torch
from step_parts import build, load

from pipeline.acceptance.features import MAX_MATCH, match_length, read_position
from pipeline.acceptance.native_reads import native_reads
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies import throughput
from pipeline.decode.policies.plan_worth import plan_pays
from pipeline.decode.types import Candidates, SamplingConfig

SECTIONS: dict[str, float] = defaultdict(float)
clock = time.perf_counter


def timed_propose(self, drafter, committed):  # throughput.ThroughputPolicy.propose, timed
    t = clock()
    mode = self.acceptance.mode(drafter.sampling.greedy)
    if drafter.sampling.greedy and mode.repeat:
        self.outcomes.memory = self._index
    self._prior = mode.prior
    if self._prompt_len is None:
        self._prompt_len = len(committed)
        self.outcomes.start(self._prompt_len)
    recent = self.outcomes.recent_or(mode.prior)
    self._ctx = len(committed)
    rho = self._rate()
    self.prices.refresh()
    self._td, self._tt = self.prices.td, self.prices.tt
    cands = Candidates()
    self.outcomes.predicted = []
    probe = self._plain_run >= self.probe_every
    t1 = clock()
    SECTIONS["step set-up"] += t1 - t
    looks = probe or self._look_pays(rho, mode, recent)
    t2 = clock()
    SECTIONS["look pays"] += t2 - t1
    if not looks:
        return cands
    cached = drafter.cached()
    probs = drafter.begin(committed)
    t3 = clock()
    SECTIONS["head forwards"] += t3 - t2
    if drafter.sampling.greedy:
        recent = self.outcomes.observe_catchup(
            drafter.logits, committed, cached, recent, drafter.ROW_AHEAD
        )
    p_chain, decay = 1.0, self.acceptance.decay
    self._index.extend(committed[len(self._index.tokens) :])
    tail = committed[-(MAX_MATCH - 1) :]
    greedy = drafter.sampling.greedy
    repeats = self.outcomes.memory is not None
    exact = (greedy or drafter.sampling.top_p >= 1.0) and not drafter.masked_logits
    temperature = 1.0 if greedy else drafter.sampling.temperature
    weights = mode.hidden_weights("both")
    native = native_reads() if exact and weights is not None and probs.is_cpu else None
    t4 = clock()
    SECTIONS["catch-up + n-gram index"] += t4 - t3
    for j in range(self._room()):
        a0 = clock()
        state = drafter.hidden[-1]
        logits = drafter.logits[-1] if exact else None
        stats, top, products = read_position(
            probs, self._index, tail, logits, temperature, state, weights, native
        )
        a1 = clock()
        SECTIONS["read_position"] += a1 - a0
        SECTIONS["decisions"] += 1
        room = self._room() - j - 1
        seen = self._index.outcome([*tail, top], match_length(stats)) if repeats else None
        a_now, later = mode.chain_view(
            stats, recent, state, room, decay, self.outcomes.offset, seen, products
        )
        self.outcomes.predicted.append(a_now)
        a2 = clock()
        SECTIONS["outcome + chain_view"] += a2 - a1
        pays = (probe and j == 0) or plan_pays(
            self._td, self._tt, rho, p_chain, [a_now, *later], j + 1, j + 1, first_free=True
        )
        a3 = clock()
        SECTIONS["plan_pays"] += a3 - a2
        if not pays:
            break
        token, conf = (top, stats[1]) if greedy else (drafter.sample(probs), None)
        cands.extend_chain(token, probs, greedy, conf)
        p_chain *= a_now
        recent = decay * recent + (1 - decay)
        later = later[: self._room() - j - 1]
        a4 = clock()
        SECTIONS["extend_chain"] += a4 - a3
        pays = bool(later) and plan_pays(
            self._td, self._tt, rho, p_chain, later, j + 2, j + 1, first_free=False
        )
        a5 = clock()
        SECTIONS["plan_pays"] += a5 - a4
        if not pays:
            break
        tail = [*tail[1:], token] if len(tail) == MAX_MATCH - 1 else [*tail, token]
        probs = drafter.extend(token)
        SECTIONS["head forwards"] += clock() - a5
    return cands


def main(artifacts: str, domains: list[str]) -> None:
    torch.set_num_threads(1)
    throughput.ThroughputPolicy.propose = timed_propose
    pair, art = load(artifacts)
    engine = SpeculativeEngine(pair)
    prompts = [
        encode(pair.tokenizer, p.text, keep_last=512)
        for dom in domains
        for p in load_prompts(dom, 8)
    ]
    total, steps = 0.0, 0
    with frozen_heap():  # (pipeline.decode.heap: no full collection inside a timed decode)
        for _ in range(2):
            for ids in prompts:
                session = engine.start(ids, build("throughput", art), SamplingConfig(0.0), seed=0)
                t0 = clock()
                while len(session.generated) < 64:
                    session.step()
                total += clock() - t0
                steps += len(session.steps)
    n = SECTIONS.pop("decisions")
    print(f"total {total * 1e3:.0f} ms, {steps} steps, {n:.0f} decisions (one per draft forward)")
    for name, s in SECTIONS.items():
        print(
            f"{name:26s} {s * 1e3:8.1f} ms {s / total:6.1%}  {s / n * 1e6:6.1f} us/decision "
            f"{s / steps * 1e6:7.1f} us/step"
        )


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "models/eagle3-head",
        sys.argv[2].split(",") if len(sys.argv) > 2 else ["code", "prose", "math"],
    )
