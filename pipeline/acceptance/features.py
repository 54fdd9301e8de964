"""What an acceptance prediction reads: a few numbers from one draft distribution (the one a
token is drawn from) plus the generation's recent acceptance. One definition, shared by the
traces the model is fitted on and the policy that queries it while drafting."""

from __future__ import annotations

import math

import torch

FEATURE_NAMES = ("bias", "log_conf", "conf", "entropy", "margin", "recent")


def distribution_stats(probs: torch.Tensor) -> torch.Tensor:
    """[..., 4]: log max q, max q, entropy (nats) and top-1 minus top-2 probability of each
    distribution in ``probs`` ([..., vocab]), computed at the decoding temperature."""
    top = probs.topk(2, dim=-1).values
    conf = top[..., 0]
    entropy = torch.special.entr(probs).sum(-1)
    return torch.stack([conf.clamp_min(1e-9).log(), conf, entropy, conf - top[..., 1]], dim=-1)


def stats_of(probs: torch.Tensor) -> list[float]:
    """distribution_stats of one distribution as floats, with fewer tensor operations (it
    runs once per draft token while deciding)."""
    top1, top2 = probs.topk(2).values.tolist()
    entropy = float(torch.special.entr(probs).sum())
    return [math.log(max(top1, 1e-9)), top1, entropy, top1 - top2]


def feature_vector(stats: list[float], recent: float) -> list[float]:
    """The model's input for one position: a bias, the distribution's stats, recent
    acceptance (an exponential moving average of the generation's outcomes)."""
    return [1.0, *stats, recent]


def logistic(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)
