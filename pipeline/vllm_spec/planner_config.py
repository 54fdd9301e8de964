"""The cost-aware scheduler's settings (pipeline.vllm_spec.step_planner), read from
``SPECBOUND_SCHEDULER`` (a JSON object of these fields) when the scheduler starts in vLLM's
engine process, and checked where a method names them (pipeline.vllm_spec.methods)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.vllm_spec.env_settings import fields_from_env
from pipeline.vllm_spec.online_step_cost import DEFAULT_COST, TERMS

ENV = "SPECBOUND_SCHEDULER"


@dataclass(frozen=True)
class PlannerConfig:
    explore: float = 0.0  # share of steps whose k is drawn at random
    # Every this many steps, two steps draft nothing (0: never): they measure what drafting at
    # all adds to a step (s0, s_row); off: at one request they cost about 2% of the tokens,
    # and no gain at 8 was measured (docs/serving_vllm.md).
    measure_off_every: int = 0
    # After this many choices of 0 in a row where rows may draft, two steps draft the best
    # k >= 1 (0: never): at k = 0 nothing measures acceptance or a drafted step's cost, so a
    # model misled against drafting would stay there (docs/serving_vllm.md). More where the
    # switches they make cost more than 2% of the time at 0 (pipeline.vllm_spec.switch_cost).
    unlock_every: int = 32
    # Switch drafting on or off only once the modelled saving has paid for a switch there and
    # back, as measured on this replica (pipeline.vllm_spec.switch_cost); off: switch as soon
    # as the best k crosses 0. Off by default: in two runs at 8 and 16 requests it bought
    # nothing measurable (docs/serving_vllm.md).
    price_switches: bool = False
    # Price drafting's prefill of every prompt by the draft, per token made (the batch's
    # prompt / output times the draft's measured prefill ms per token:
    # pipeline.vllm_spec.draft_prefill); off: steady decode steps only.
    price_prefill: bool = True
    forget: float = 0.995  # per-step forgetting of the step-cost fit
    decay: float = 0.98  # per judged chain, of a request's acceptance counts
    # Per step, the share by which acceptance evidence fades back to the prior (the offline
    # rate of the mode; a request's: its mode's pooled rate): a replica that stopped drafting
    # on bad luck measures no acceptance, and without this would never draft again.
    revert: float = 0.01
    prior_rate: float = 0.6  # acceptance before any evidence, where no offline model says
    prior_weight: float = 4.0  # judged tokens that prior is worth
    # Prior step cost (ms) where no calibration is found, in online_step_cost.TERMS' order:
    # c0, c_pos, c_union, c_row, d0, d_row, s0, s_row.
    prior_cost: tuple[float, ...] = DEFAULT_COST
    prior_precision: float = 1.0  # per coefficient; a calibration's prior: 25
    offline_priors: bool = True  # start from the pair's acceptance model and calibration
    # policy: choose; fixed: always K (a like-for-like peer); off: always 0 (no draft forward
    # with the plugin's drafter: speculation off on a speculating engine)
    design: str = "policy"
    trim: bool = True  # verify a drafted chain only as far as the marginal rule keeps it
    # Price a row's j-th draft at its rate times the depth's measured factor (accepted there
    # over what the rates expected, pipeline.vllm_spec.row_acceptance); off: a geometric chain.
    depth_factors: bool = True
    # Fit the step cost's row term and drafting terms (c_row, s0, s_row); false holds them at
    # 0 (the form without them, for comparison).
    row_terms: bool = True
    # Price k = 0 at the lower of two fits of the same steps, the second putting what drafted
    # steps measure above the prior on drafting (pipeline.vllm_spec.online_step_cost); off:
    # the main fit alone, which puts it on terms steps at 0 pay too. Off by default: in vLLM
    # it measured steps at 0 as built (at 16 requests 1,282 against 96) and lost 7-11% at 16
    # ShareGPT requests by choosing 0 for 30% of the steps (docs/serving_vllm.md).
    zero_fit: bool = False
    # The acceptance stop (pipeline.vllm_spec.acceptance_stop): a greedy row's chain ends where
    # the pair's acceptance model puts the chance that all of it is accepted, times the next
    # token's, below this (0: off; the draft model's drafter only).
    stop_below: float = 0.0
    # The A/B check (pipeline.vllm_spec.ab_check): epochs of this many steps run either as
    # the planner chooses or held at 0 (and at ab_fixed where set), and per batch size the
    # side that made the most tokens per millisecond runs, the others re-checked now and then
    # (0: off).
    ab_epoch: int = 0
    ab_fixed: int = 0  # a K the check also holds besides 0 (0: none; at most the engine's K)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"explore {self.explore}: between 0 and 1")
        if not 0.5 <= self.forget <= 1.0 or not 0.5 <= self.decay <= 1.0:
            raise ValueError("forget and decay: between 0.5 and 1")
        if not 0.0 <= self.revert <= 0.5:
            raise ValueError(f"revert {self.revert}: between 0 and 0.5")
        if not 0.0 < self.prior_rate < 1.0 or self.prior_weight <= 0:
            raise ValueError("prior_rate in (0, 1), prior_weight > 0")
        if len(self.prior_cost) != len(TERMS) or self.prior_precision <= 0:
            raise ValueError(
                f"prior_cost: {len(TERMS)} numbers ({', '.join(TERMS)}); precision > 0"
            )
        if self.unlock_every < 0:
            raise ValueError(f"unlock_every {self.unlock_every}: 0 (never) or more")
        if self.measure_off_every < 0:
            raise ValueError(f"measure_off_every {self.measure_off_every}: 0 (never) or more")
        if self.ab_epoch < 0 or self.ab_fixed < 0:
            raise ValueError(f"ab_epoch {self.ab_epoch}, ab_fixed {self.ab_fixed}: 0 (off) or more")
        if not 0.0 <= self.stop_below < 1.0:
            raise ValueError(f"stop_below {self.stop_below}: 0 (off) or below 1")
        if self.design not in ("policy", "fixed", "off"):
            raise ValueError(f"design {self.design!r}: policy, fixed or off")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PlannerConfig:
        data = fields_from_env(cls, ENV, environ)
        if "prior_cost" in data:
            data["prior_cost"] = tuple(float(x) for x in data["prior_cost"])
        return cls(**data)
