"""What one tensor call costs right after a draft forward, against the same call again, and
against the same call on a tensor the forward never touched: the 1-layer draft drafts chains
of 12 tokens from 600 prompts, and after each forward one variant (in rotation) is timed on
the distribution it produced. Run from the repository root on a quiet machine:

    python docs/results/cold_decisions_2026-12-04/cold_ops.py

Variants: the tensor calls one decision makes, alone and together (`stats + hidden, before`:
features._top_stats and the hidden-state product as they were, each casting its inputs; `now`:
casting only what is not float32 already, as they do now; `one compiled call`: the same reads
made by pipeline.acceptance.native_reads, as `throughput` makes them where a C compiler
exists)."""

import math
import time

import torch

from pipeline.acceptance import features
from pipeline.acceptance.native_reads import native_reads
from pipeline.decode.drafter import Drafter
from pipeline.decode.randomness import TorchRandom
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

torch.set_num_threads(1)
pair = load_pair("models/target", "models/draft", "cpu", "float32", "eager")
other = torch.softmax(torch.randn(pair.draft.config.vocab_size), -1)  # never near a forward
both = torch.randn(pair.draft.config.hidden_size, 2)
NATIVE = native_reads()  # (None without a C compiler: that variant then fails)


def stats_before(probs, logits, hidden):  # features._top_stats and the product, as they were
    probs = probs.float()
    values, indices = probs.topk(2)
    top1, top2 = values.tolist()
    top = indices.tolist()[0]
    logits = logits.float()
    entropy = float(logits[top]) - float(torch.dot(probs, logits)) - math.log(top1)
    return (top1, top2, entropy), (hidden.float().cpu() @ both).tolist()


def stats_now(probs, logits, hidden):
    stats = features._top_stats(probs, logits, 1.0)
    if not hidden.is_cpu or hidden.dtype != torch.float32:
        hidden = hidden.float().cpu()
    return stats, (hidden @ both).tolist()


def topk(t):
    values, indices = t.topk(2)
    return values.tolist(), indices.tolist()


VARIANTS = {
    "nothing": lambda p, z, h: None,
    "topk(2)": lambda p, z, h: topk(p),
    "topk(2), then again": lambda p, z, h: (topk(p), topk(p)),
    "topk(2) of another tensor": lambda p, z, h: topk(other),
    "dot": lambda p, z, h: float(torch.dot(p, z)),
    "dot of another tensor": lambda p, z, h: float(torch.dot(other, other)),
    "argmax": lambda p, z, h: int(p.argmax()),
    "logits[top]": lambda p, z, h: float(z[7]),
    "hidden @ weights": lambda p, z, h: (h @ both).tolist(),
    "stats + hidden, before": stats_before,
    "stats + hidden, now": stats_now,
    "the same, one compiled call": lambda p, z, h: NATIVE.read(p, z, h, both),
}


def main() -> None:
    names = list(VARIANTS)
    total = dict.fromkeys(names, 0.0)
    count = dict.fromkeys(names, 0)
    turn = 0
    last = ()
    with torch.no_grad():
        for rep in range(600):
            drafter = Drafter(pair, SamplingConfig(0.0), TorchRandom(0))
            probs = drafter.begin(list(range(5 + rep, 40 + rep)))
            for _ in range(12):
                probs = drafter.extend(int(probs.argmax()))
                name = names[turn % len(names)]
                turn += 1
                args = (probs, drafter.logits[-1], drafter.hidden[-1])
                t = time.perf_counter()
                VARIANTS[name](*args)
                total[name] += time.perf_counter() - t
                count[name] += 1
                last = args
        # The same calls warm: back to back on the last forward's outputs.
        warm = {}
        for name in names:
            t = time.perf_counter()
            for _ in range(2000):
                VARIANTS[name](*last)
            warm[name] = (time.perf_counter() - t) / 2000
    print(f"{'call':28s} {'after a forward':>16s} {'warm':>8s}")
    for name in names:
        after = total[name] / count[name]
        print(
            f"{name:28s} {after * 1e6:13.1f} us {warm[name] * 1e6:5.1f} us  ({count[name]} calls)"
        )


if __name__ == "__main__":
    main()
