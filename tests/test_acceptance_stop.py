"""The acceptance stop's bookkeeping and decisions (pipeline.vllm_spec.acceptance_stop), on
the committed acceptance model; in real vLLM: tests/test_vllm_plugin.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.acceptance.model import AcceptanceModel
from pipeline.vllm_spec.acceptance_stop import AcceptanceStop, StopDrafting

MODEL = AcceptanceModel.load(Path(__file__).resolve().parents[1] / "models" / "acceptance.json")
VOCAB, HIDDEN = 4096, 128


def _stop(below: float = 0.3) -> AcceptanceStop:
    return AcceptanceStop(MODEL, below)


def _committed(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    table = np.zeros((len(rows), 32), dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table, np.array([len(r) for r in rows])


def _logits(peaks: list[int | None]) -> torch.Tensor:
    """One row per entry: sharply on that token, or flat (None)."""
    out = torch.zeros(len(peaks), VOCAB)
    for i, token in enumerate(peaks):
        if token is not None:
            out[i, token] = 30.0
    return out


def test_the_stop_follows_each_request_text_and_recent_acceptance():
    stop = _stop()
    decay, prior = MODEL.decay, MODEL.mode(greedy=True).prior
    # Row 0 verified 2 drafts (7, 8) after its last token 3, accepted 1, then sampled 9; row 1
    # is a prompt chunk (positions 0-1 of a 4-token prompt): not followed.
    table, counts = _committed([[1, 2, 3], [5, 6, 7, 8]])
    stop.begin(
        ["a", "b"], table, counts, np.array([2, 0]), np.array([3, 2]),
        [3, 7, 8, 5, 6], [9, 0], [1, 0], 2,
    )  # fmt: skip
    text = stop.texts["a"]
    assert text.index.tokens == [1, 2, 3, 7, 9]
    assert text.recent == pytest.approx(decay * (decay * prior + 1 - decay))
    assert stop.step.rows[1] is None
    assert stop.proposals(2, torch.device("cpu")).tolist() == [[-1, -1], [-1, -1]]
    # Next step: the runner has committed 7 and 9; the row verified nothing and sampled 4.
    table, counts = _committed([[1, 2, 3, 7, 9]])
    stop.begin(["a"], table, counts, np.array([4]), np.array([1]), [9], [4], None, 2)
    assert text.index.tokens == [1, 2, 3, 7, 9, 4]
    assert text.recent == pytest.approx(decay * (decay * prior + 1 - decay))


def test_a_sure_copied_token_is_proposed_and_a_flat_guess_ends_the_loop():
    stop = _stop()
    # Both rows' text repeats 10 11 12 10 11; after it the draft is sure of 12 (a copy) or
    # flat.
    text = [10, 11, 12, 10, 11]
    table, counts = _committed([text, text])
    stop.begin(
        ["a", "b"], table, counts, np.array([4, 4]), np.array([1, 1]), [11, 11], [12, 12],
        None, 4,
    )  # fmt: skip
    hidden = torch.zeros(2, HIDDEN)
    stop.judge(_logits([10, None]), hidden, torch.tensor([10, 3]))
    assert stop.step.chains == [[10], []]
    assert stop.step.live == [True, False]
    with pytest.raises(StopDrafting):  # the last live row stops with positions of k left
        stop.judge(_logits([None, None]), hidden, torch.tensor([5, 5]))
    assert stop.proposals(2, torch.device("cpu")).tolist() == [[10, -1, -1, -1], [-1] * 4]
    assert stop.stopped_steps == 1 and stop.step is None


def test_a_chain_that_runs_to_k_keeps_vllms_tokens_and_cuts_the_stopped_rows():
    stop = _stop()
    text = [10, 11, 12, 13, 10]  # then 11 sampled: the draft copies 12 13
    table, counts = _committed([text, text])
    stop.begin(
        ["a", "b"], table, counts, np.array([4, 4]), np.array([1, 1]), [10, 10], [11, 11],
        None, 2,
    )  # fmt: skip
    hidden = torch.zeros(2, HIDDEN)
    stop.judge(_logits([12, None]), hidden, torch.tensor([12, 3]))
    stop.judge(_logits([13, None]), hidden, torch.tensor([13, 4]))
    drafted = torch.tensor([[12, 13], [3, 4]])
    assert stop.finish(drafted).tolist() == [[12, 13], [-1, -1]]
    assert stop.stopped_steps == 0


def test_the_stop_refuses_a_threshold_outside_0_1():
    with pytest.raises(ValueError, match="stop_below"):
        _stop(1.0)


def test_the_stops_predictions_are_the_acceptance_models():
    stop, mode = _stop(), MODEL.mode(greedy=True)
    rng = np.random.default_rng(0)
    for _ in range(20):
        stats = [float(x) for x in rng.normal(size=7)]
        recent, hidden = float(rng.uniform()), torch.randn(HIDDEN)
        products = (hidden @ mode.hidden_weights("both")).tolist()
        now, later = mode.chain_view(stats, recent, hidden, 1, MODEL.decay)
        assert stop.predict(stats, recent, products) == pytest.approx((now, later[0]), rel=1e-5)
