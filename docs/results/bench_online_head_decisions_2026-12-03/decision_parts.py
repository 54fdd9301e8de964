"""Where `throughput`'s step time goes with the head, outside the head's forwards: its
propose re-run with a timer between the parts (the same code, timed), on 8 math and 8 code
prompts x 64 tokens. Run from the repository root:
PYTHONPATH=docs/results/bench_online_head_2026-12-03 python <this file>."""

import time
from collections import defaultdict

from verify_diag import head_setup  # docs/results/bench_online_head_2026-12-03

from pipeline.acceptance.features import MAX_MATCH, position_view
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies import throughput
from pipeline.decode.policies.plan_worth import plan_pays
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import Candidates

TOTAL: dict[str, float] = defaultdict(float)
COUNT: dict[str, int] = defaultdict(int)


def tick(name: str, since: float) -> float:
    now = time.perf_counter()
    TOTAL[name] += now - since
    COUNT[name] += 1
    return now


def propose(self, drafter, committed):  # ThroughputPolicy.propose, timed part by part
    t = time.perf_counter()
    mode = self.acceptance.mode(drafter.sampling.greedy)
    self._prior = mode.prior
    recent = self.outcomes.recent_or(mode.prior)
    self._ctx = len(committed)
    rho, k_max = self._rate(), self.max_k
    self.prices.refresh()
    self._td, self._tt = self.prices.td, self.prices.tt
    cands = Candidates()
    self.outcomes.predicted = []
    probe = self._plain_run >= self.probe_every
    t = tick("setup", t)
    if not probe and not self._look_pays(rho, mode, recent):
        return cands
    t = tick("look decision", t)
    cached = drafter.cached()
    probs = drafter.begin(committed)
    t = tick("FORWARD begin", t)
    if drafter.sampling.greedy:
        recent = self.outcomes.observe_catchup(drafter.logits, committed, cached, recent)
    t = tick("catch-up check", t)
    p_chain, decay = 1.0, self.acceptance.decay
    self._index.extend(committed[len(self._index.tokens) :])
    tail = committed[-(MAX_MATCH - 1) :]
    greedy = drafter.sampling.greedy
    t = tick("n-gram index", t)
    for j in range(k_max):
        stats, top = position_view(probs, self._index, tail)
        t = tick("statistics", t)
        state = drafter.hidden[-1]
        a_now, later = mode.chain_view(
            stats, recent, state, k_max - j - 1, decay, self.outcomes.offset
        )
        t = tick("acceptance model", t)
        accs = [a_now, *later]
        if not (probe and j == 0) and not plan_pays(
            self._td, self._tt, rho, p_chain, accs, j + 1, j + 1, first_free=True
        ):
            break
        t = tick("plan worth (this token)", t)
        token, conf = (top, stats[1]) if greedy else (drafter.sample(probs), None)
        cands.extend_chain(token, probs, greedy, conf)
        self.outcomes.predicted.append(a_now)
        p_chain *= a_now
        recent = decay * recent + (1 - decay)
        t = tick("draft the token", t)
        if not later or not plan_pays(
            self._td, self._tt, rho, p_chain, later, j + 2, j + 1, first_free=False
        ):
            break
        t = tick("plan worth (the next)", t)
        tail = [*tail[1:], token] if len(tail) == MAX_MATCH - 1 else [*tail, token]
        probs = drafter.extend(token)
        t = tick("FORWARD extend", t)
    return cands


def main() -> None:
    throughput.ThroughputPolicy.propose = propose
    pair, art = head_setup()
    engine = SpeculativeEngine(pair)
    for domain in ("math", "code"):
        for p in load_prompts(domain, 8):
            engine.generate(
                encode(pair.tokenizer, p.text, keep_last=512), make_policy("throughput", art), 64
            )
    for name, total in TOTAL.items():
        print(
            f"{name:24s} n {COUNT[name]:5d}  {total * 1000:8.1f} ms  "
            f"{total / COUNT[name] * 1e6:7.1f} us each"
        )


if __name__ == "__main__":
    main()
