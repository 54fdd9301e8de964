"""The worth of drafting n more tokens at a rate rho (ms a token is worth), as `throughput`
prices it: rho * E[tokens the plan adds] minus the modelled cost it adds, over plans
n = 1 .. len(accs). ``td[f]`` is the modelled draft time of f forwards, ``tt[m]`` the target's
verification of m positions (pipeline.decode.policies.prices, this step's tables)."""

from __future__ import annotations

from collections.abc import Sequence


def plan_worth(
    td: Sequence[float],
    tt: Sequence[float],
    rho: float,
    p: float,
    accs: Sequence[float],
    m: int,
    forwards: int,
    first_free: bool,
) -> float:
    """The best worth over plans of n = 1 .. len(accs) more tokens, after a chain of m
    positions whose draft ran ``forwards`` forwards and is accepted with probability ``p``;
    ``accs[i]`` is token i's acceptance given the ones before it. ``first_free``: the first
    token's distribution is already computed (its forward ran)."""
    t_d0, t_t0 = td[forwards], tt[m]
    gain, best = 0.0, float("-inf")
    for n, a in enumerate(accs, 1):
        p *= a
        gain += rho * p
        more = forwards + (n - 1 if first_free else n)
        best = max(best, gain - (td[more] - t_d0) - (tt[m + n] - t_t0))
    return best


def plan_pays(
    td: Sequence[float],
    tt: Sequence[float],
    rho: float,
    p: float,
    accs: Sequence[float],
    m: int,
    forwards: int,
    first_free: bool,
) -> bool:
    """plan_worth(...) > 0, stopping at the first plan that pays (most decisions go on)."""
    t_d0, t_t0 = td[forwards], tt[m]
    gain = 0.0
    for n, a in enumerate(accs, 1):
        p *= a
        gain += rho * p
        more = forwards + (n - 1 if first_free else n)
        if gain > (td[more] - t_d0) + (tt[m + n] - t_t0):
            return True
    return False
