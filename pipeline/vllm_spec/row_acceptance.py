"""Each request's per-token acceptance rate as the cost-aware scheduler estimates it from the
chains vLLM verifies (numpy-free: it runs in vLLM's engine process).

A drafted chain of k tokens is accepted up to its first rejection, so each judged chain gives
``accepted`` successes and (when ``accepted < k``) one failure of a per-token rate ``a``; the
estimate is the decayed ratio with a prior, per request and per decoding mode (greedy,
sampled: a row is priced at its own temperature). A new request starts from its mode's pooled
rate, which starts from the offline acceptance model's mean for that mode
(pipeline.vllm_spec.priors). The estimates follow recent chains (``decay`` per chain); the
run's undecayed totals are kept beside them, to compare with vLLM's own counters.

While nothing is drafted nothing is judged, and every estimate fades (``revert`` per step)
toward its mode's longer memory: the offline rate at first, then the replica's own chains over
the last few hundred (LONG_DECAY). It used to fade to the offline rate itself, which for
ShareGPT (0.728) sits above what the replica measures online (0.55-0.63): every stretch at 0
pulled the estimates up until drafting looked worth it again, and the replica drafted at 16
requests where drafting loses (docs/serving_vllm.md).

**Depth factors.** A geometric chain gives its j-th draft the row's rate ``a`` whatever j;
measured at 16 requests, chains of 4 accepted 2.62 tokens where that expected 3.17, chains of
1 above it (0.66 / 0.58): deep tokens are accepted less than the first, and the rows kept long
are those whose noisy estimates are high. So each mode keeps, per depth j, the drafts judged
there against the rates the estimates gave them; a row's j-th draft is accepted, once its
j - 1 before were, at ``min(a f_j, 0.995)`` with ``f_j`` that ratio (a prior of 1 worth
DEPTH_PRIOR expected acceptances, decayed DEPTH_DECAY a chain): ``reach`` is what the choice and the
marginal rule price a chain with.
"""

from __future__ import annotations

LONG_DECAY = 0.995  # per judged chain, of a mode's longer memory (the estimates' fade target)
DEPTH_DECAY = 0.999  # per judged chain, of the depth factors' counts
DEPTH_PRIOR = 10.0  # expected acceptances a depth factor's prior of 1 is worth
TOP_RATE = 0.995


class RowAcceptance:
    def __init__(
        self,
        mode_rates: dict[str, float],
        prior_weight: float = 4.0,
        decay: float = 0.98,
        revert: float = 0.01,
        depth_factors: bool = True,
    ):
        self.mode_rates = dict(mode_rates)
        self.prior_weight = prior_weight  # judged tokens the prior is worth
        self.decay = decay  # per judged chain
        # Per step, the share by which evidence fades back to the prior: a replica that
        # stopped drafting on bad luck measures no acceptance, and would never draft again.
        self.revert = revert
        w = prior_weight
        self.requests: dict[str, list[float]] = {}  # id -> [accepted, trials]
        self.modes: dict[str, str] = {}  # id -> greedy | sampled
        self.pooled = {m: [r * w, w] for m, r in self.mode_rates.items()}
        self.long = {m: [r * w, w] for m, r in self.mode_rates.items()}
        self.judged = {m: [0, 0] for m in self.mode_rates}  # the run's accepted, drafted
        # drafted length -> [accepted, accepted as the choice priced it, chains]: whether the
        # prices held for the chains they chose (a report)
        self.by_length: dict[int, list[float]] = {}
        self.use_depth = depth_factors
        # mode -> per depth j = 1, 2, ...: [drafts accepted there, what the rows' rates expected]
        self.depth: dict[str, list[list[float]]] = {m: [] for m in self.mode_rates}

    def set_mode(self, request_id: str, mode: str) -> None:
        self.modes[request_id] = mode

    def mode(self, request_id: str) -> str:
        return self.modes.get(request_id, "greedy")

    def rate(self, request_id: str) -> float:
        mode = self.mode(request_id)
        acc, trials = self.requests.get(request_id, self.pooled[mode])
        if trials <= 0:
            return self.mode_rates[mode]
        return min(max(acc / trials, 0.0), TOP_RATE)

    def factors(self, mode: str, k: int) -> list[float]:
        """The depth factors f_1..f_k of a mode (1 without evidence, or when turned off)."""
        seen = self.depth[mode] if self.use_depth else []
        return [
            (seen[j][0] + DEPTH_PRIOR) / (seen[j][1] + DEPTH_PRIOR) if j < len(seen) else 1.0
            for j in range(k)
        ]

    def reach(self, request_id: str, k: int) -> list[float]:
        """Probability that each of a row's first k drafts is accepted (its prefix with it)."""
        a, p, out = self.rate(request_id), 1.0, []
        for f in self.factors(self.mode(request_id), k):
            p *= min(a * f, TOP_RATE)
            out.append(p)
        return out

    def observe_chain(self, request_id: str, drafted: int, accepted: int) -> None:
        """One judged chain: ``accepted`` of ``drafted`` tokens kept (a prefix)."""
        if drafted <= 0:
            return
        accepted = min(max(accepted, 0), drafted)
        trials = accepted + (1 if accepted < drafted else 0)
        a, mode = self.rate(request_id), self.mode(request_id)
        seen = self.by_length.setdefault(drafted, [0.0, 0.0, 0])
        seen[0] += accepted
        seen[1] += sum(self.reach(request_id, drafted))  # what the choice priced it at
        seen[2] += 1
        depth = self.depth[mode]
        depth.extend([0.0, 0.0] for _ in range(drafted - len(depth)))
        for j, counts in enumerate(depth):
            counts[0] *= DEPTH_DECAY
            counts[1] *= DEPTH_DECAY
            if j < trials:  # the j+1-th draft was judged: every one up to the first rejection
                counts[0] += j < accepted
                counts[1] += a
        self.judged[mode][0] += accepted
        self.judged[mode][1] += drafted
        pooled = self.pooled[mode]
        if request_id not in self.requests:
            rate = pooled[0] / pooled[1]
            self.requests[request_id] = [rate * self.prior_weight, self.prior_weight]
        for counts in (self.requests[request_id], pooled):
            counts[0] = self.decay * counts[0] + accepted
            counts[1] = self.decay * counts[1] + trials
        long = self.long[mode]
        long[0] = LONG_DECAY * long[0] + accepted
        long[1] = LONG_DECAY * long[1] + trials

    def long_rate(self, mode: str) -> float:
        """The mode's rate over the replica's last few hundred chains (the offline rate
        before any): what the estimates fade to while nothing is judged."""
        acc, trials = self.long[mode]
        return acc / trials if trials > 0 else self.mode_rates[mode]

    def fade_to_prior(self) -> None:
        """One step's ``revert`` of every estimate toward its prior: a request's toward its
        mode's pooled rate, the pooled rate toward the mode's longer memory."""
        r, w = self.revert, self.prior_weight
        if r <= 0:
            return
        for mode, counts in self.pooled.items():
            counts[0] += r * (self.long_rate(mode) * w - counts[0])
            counts[1] += r * (w - counts[1])
        for request_id, counts in self.requests.items():
            pooled = self.pooled[self.mode(request_id)]
            counts[0] += r * (pooled[0] / pooled[1] * w - counts[0])
            counts[1] += r * (w - counts[1])

    def forget(self, alive: set[str]) -> None:
        for gone in set(self.requests) - alive:
            del self.requests[gone]
        for gone in set(self.modes) - alive:
            del self.modes[gone]

    def report(self) -> str:
        recent = ", ".join(f"{m} {a / t:.3f}" for m, (a, t) in self.pooled.items() if t > 0)
        run = ", ".join(f"{m} {a / d:.3f}" for m, (a, d) in self.judged.items() if d > 0)
        lengths = ", ".join(
            f"{d}: {acc / n:.2f}/{model / n:.2f} ({n})"
            for d, (acc, model, n) in sorted(self.by_length.items())
        )
        depth = "; ".join(
            f"{m} " + " ".join(f"{f:.2f}" for f in self.factors(m, len(self.depth[m])))
            for m in self.mode_rates
            if self.depth[m]
        )
        return (
            f"pooled acceptance (recent chains) {recent}; accepted / drafted over the run "
            f"{run or '-'}; accepted per chain measured/modelled by its length {lengths or '-'}; "
            f"depth factors {depth or '-'}"
        )
