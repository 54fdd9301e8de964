"""Would drafting from the draft at another temperature be accepted more often at T = 1?
Rejection sampling is lossless for any proposal q', and accepts a drawn token with
probability sum_x min(p(x), q'(x)). Text sampled from the target at T = 1 (held-out prompts
8-15 of each domain, 64 tokens each), the target's p and the draft's softmax(z / tau) at every
generated position, teacher-forced. Run from the repository root:

    python docs/results/cold_decisions_2026-12-04/draft_temperature.py [DRAFT]

DRAFT: models/draft (default) or models/draft-2layer."""

import sys

import torch

from pipeline.data.domains import load_domain
from pipeline.data.prompts import encode
from pipeline.models.loading import load_pair

TAUS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)


@torch.no_grad()
def main(draft: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pair = load_pair("models/target", draft, "cpu", "float32", "eager")
    for domain in ("code", "prose", "math"):
        overlap, positions = torch.zeros(len(TAUS)), 0
        for prompt in load_domain(domain, 16)[8:16]:
            ids = encode(pair.tokenizer, prompt.text, keep_last=512)
            seq = pair.target.generate(
                torch.tensor([ids]),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=64,
                min_new_tokens=64,
            )[0]
            p = torch.softmax(pair.target(seq[None]).logits[0].float(), -1)[len(ids) - 1 : -1]
            z = pair.draft(seq[None]).logits[0].float()[len(ids) - 1 : -1]
            for i, tau in enumerate(TAUS):
                overlap[i] += torch.minimum(p, torch.softmax(z / tau, -1)).sum()
            positions += p.shape[0]
        row = " ".join(
            f"{tau}: {float(a) / positions:.4f}" for tau, a in zip(TAUS, overlap, strict=True)
        )
        print(f"{domain:6s} mean sum min(p, q_tau) over {positions} positions  {row}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/draft")
