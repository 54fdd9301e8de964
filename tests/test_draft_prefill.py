"""What drafting costs for the draft's prefill of the prompts (pipeline.vllm_spec.draft_prefill),
without vLLM: its price per token made from the catch-ups and the requests' shapes, and a
planner that stops drafting where the prompts make drafting lose and keeps drafting where it
pays."""

from __future__ import annotations

import pytest
from planner_steps import with_prompts

from pipeline.vllm_spec.draft_prefill import DraftPrefill
from pipeline.vllm_spec.planner_config import PlannerConfig


class _Cost:
    """The step-cost fit's one term the price reads: ``d_row``."""

    def coefficient(self, term: str, rows: int) -> float:
        assert term == "d_row"
        return 0.05


def test_the_price_per_token_is_the_prompts_share_at_the_catch_ups_measured_cost() -> None:
    prefill = DraftPrefill(_Cost())
    assert prefill.per_token(["a"]) == 0.0 and prefill.catch_up_ms(["a"]) == 0.0  # unknown
    prefill.set_shape("a", 300, 128)
    prefill.set_shape("b", 64, 128)
    # before any catch-up, the prior: d_row per prefilled token
    assert prefill.per_token(["a", "b"]) == pytest.approx(0.05 * (300 / 128 + 64 / 128) / 2)
    for i in range(200):  # catch-ups of 10 and 100 tokens: a 0.5 ms switch, 0.02 ms a token
        tokens = 10 if i % 2 else 100
        prefill.observe_catch_up(0.5 + 0.02 * tokens, tokens)
    price = prefill.ms_per_token(16)
    assert price == pytest.approx(0.02, rel=1e-4)  # not the ratio: 0.025 / 0.07 a token
    assert prefill.catch_up_ms(["a", "b"]) == pytest.approx(price * (300 + 128 + 64 + 128))
    # requests that end after 64 tokens: a row's output is at most their mean
    prefill.ended("b", 64)
    assert prefill.per_token(["a"]) == pytest.approx(price * 300 / 64)
    prefill.forget({"a"})
    assert set(prefill.shapes) == {"a"}
    assert "draft prefill 0.0200 ms/token (catch-ups' intercept 0.50 ms) over 11000" in (
        prefill.report()
    )


@pytest.mark.parametrize(
    ("prompt", "rate"),
    [(192, 0.55), (40, 0.75)],
    ids=["long prompts, drafting loses", "short prompts, drafting pays"],
)
def test_a_planner_that_prices_the_prompts_drafts_where_they_leave_a_gain(
    prompt: int, rate: float
) -> None:
    """16 rows, the draft's prefill at 0.05 ms a token (a 16-row step at 0: 10 ms). Prompts
    of 192 tokens for 128 made, acceptance 0.55 (on steady steps k = 1 gains 4%): the
    prompts' share costs drafting 12%; blind to it the planner spent 0.692 ms per token
    (drafted at 3% of steps, each switch on catching up the rows' stretches at 0), never
    drafting 0.630, pricing it 0.638 (two unlocks). Prompts of 40, acceptance 0.75: drafting
    at every step is best (0.496 against 0.624), and the priced planner does."""
    run = {"prompt": prompt, "rate": rate, "draft_prefill": 0.05}
    never, _, _ = with_prompts(PlannerConfig(design="off"), **run)
    blind, _, _ = with_prompts(PlannerConfig(price_prefill=False), **run)
    priced, drafted, _ = with_prompts(PlannerConfig(), **run)
    assert priced <= 1.015 * min(never, blind)
    if prompt > 100:
        assert blind > 1.05 * never and drafted < 0.01
    else:
        assert never > 1.2 * blind and drafted == 1.0
