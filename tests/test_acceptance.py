"""The acceptance model (pipeline/acceptance): traces label what verification would do, the
logistic fit recovers known weights from soft labels, recent acceptance only looks back, the
saved model round-trips and refuses a stale file, and the job trains end to end on the
embedded models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.acceptance.features import (
    FEATURE_NAMES,
    MAX_MATCH,
    NgramIndex,
    context_features,
    distribution_stats,
    match_features,
    position_stats,
    position_view,
    stats_of,
)
from pipeline.acceptance.logistic import fit_logistic
from pipeline.acceptance.model import AcceptanceModel, ModeModel
from pipeline.acceptance.traces import AcceptanceTrace, trace_prompt
from pipeline.acceptance.training import design, fit_acceptance
from pipeline.data.prompts import Prompt
from pipeline.decode.types import SamplingConfig

W = len(FEATURE_NAMES)


def test_distribution_stats_of_a_known_distribution():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    log_conf, conf, entropy, margin = distribution_stats(probs)[0].tolist()
    assert conf == pytest.approx(0.5) and log_conf == pytest.approx(np.log(0.5))
    assert entropy == pytest.approx(-(0.5 * np.log(0.5) + 0.5 * np.log(0.25)), rel=1e-6)
    assert margin == pytest.approx(0.25)
    assert stats_of(probs[0]) == pytest.approx(distribution_stats(probs)[0].tolist(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_per_token_stats_equal_the_batched_ones(dtype):
    """The policies' per-token path reads what the acceptance model was trained on
    (distribution_stats), on a full vocabulary, with zeros and a tie at the top."""
    gen = torch.Generator().manual_seed(0)
    cases = [torch.softmax(3 * torch.randn(4096, generator=gen), -1) for _ in range(4)]
    cases += [torch.tensor([0.4, 0.4, 0.2, 0.0]), torch.tensor([0.0, 0.0, 1.0])]
    for probs in cases:
        probs = probs.to(dtype)
        expected = distribution_stats(probs[None])[0].tolist()  # in the same dtype
        rel = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the batched log is in bf16
        assert stats_of(probs) == pytest.approx(expected, rel=rel, abs=1e-6)
        assert position_stats(probs, NgramIndex(), [])[:4] == stats_of(probs)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_the_entropy_read_off_the_logits_is_the_distributions(temperature):
    """With the logits (softmax(logits / T) is ``probs``) the entropy is one dot product; it
    equals -sum p log p, and masked logits (-inf, a reduced draft vocabulary) fall back."""
    gen = torch.Generator().manual_seed(1)
    index, tail = NgramIndex(), [3, 5]
    index.extend([3, 5, 7, 3, 5])
    for scale in (0.5, 3.0, 12.0):
        logits = scale * torch.randn(4096, generator=gen)
        logits[7] += 4.0  # a clear top token, which continues "3 5" in the text
        probs = torch.softmax(logits / temperature, -1)
        view = position_view(probs, index, tail, logits, temperature)
        assert view[1] == position_view(probs, index, tail)[1] == int(probs.argmax())
        assert view[0] == pytest.approx(position_view(probs, index, tail)[0], rel=1e-4, abs=1e-5)
    masked = torch.randn(64, generator=gen)
    masked[::2] = float("-inf")
    probs = torch.softmax(masked, -1)
    assert position_view(probs, index, tail, masked)[0] == position_view(probs, index, tail)[0]


def test_the_context_index_keeps_each_ngrams_two_latest_ends():
    index = NgramIndex()
    index.extend([1, 2, 1, 2])
    index.extend([1])
    assert index._ends[(1,)] == (4, 2) and index._ends[(1, 2)] == (3, 1)
    assert index._ends[(2, 1)] == (4, 2) and index._ends[(1, 2, 1, 2, 1)] == (4, -1)
    assert len(index._ends) == 9  # 1 2 1 2 1: two distinct n-grams for n = 1..4, one 5-gram


def test_context_match_is_the_longest_ngram_already_in_the_text():
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 1, 2])
    assert index.match([], 3) == 1 and index.match([], 9) == 0
    assert index.match([3, 4, 1], 2) == 4  # "3 4 1 2" occurred
    assert index.match([4, 1, 2], 3) == 3  # "1 2 3" occurred, "4 1 2 3" did not
    assert index.match([1, 2], 9) == 0  # the token itself never occurred
    long = list(range(20)) * 2
    index.extend(long)
    assert index.match(long[:15], 15) == MAX_MATCH  # capped
    assert match_features(0) == [0.0, 0.0, 0.0] and match_features(4) == [0.5, 1.0, 1.0]


def test_context_features_match_position_by_position_what_the_policy_sees():
    context, text, proposed = [5, 6, 7, 5, 6], [7, 8, 5], [7, 9, 6]
    feats = context_features(context, text, proposed)
    # 7 after "5 6": "5 6 7" occurred; 9 never; 6 after "... 7 8": only "6" itself occurred.
    assert feats == [match_features(3), match_features(0), match_features(1)]
    index = NgramIndex()
    index.extend(context)
    probs = torch.zeros(10)
    probs[7], probs[2] = 0.7, 0.3
    stats = position_stats(probs, index, context)
    assert stats[:4] == pytest.approx(stats_of(probs), rel=1e-6)
    assert stats[4:] == match_features(3) and len(stats) == W - 2


def test_logistic_fit_recovers_weights_from_soft_labels():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(20000), rng.normal(size=(20000, 2))])
    w = np.array([0.5, 2.0, -1.0])
    y = 1 / (1 + np.exp(-(x @ w)))  # probabilities as labels (the sampled mode's)
    fit = fit_logistic(x, y, l2=0.0)
    assert fit.weights == pytest.approx(w, abs=1e-3)
    assert fit.converged and 0 < fit.iterations < 50
    # Integer row weights are repeated rows.
    counts = rng.integers(0, 3, size=len(y)).astype(float)
    repeated = np.repeat(np.arange(len(y)), counts.astype(int))
    assert fit_logistic(x, y, l2=0.0, weights=counts).weights == pytest.approx(
        fit_logistic(x[repeated], y[repeated], l2=0.0).weights, abs=1e-6
    )
    # The ridge is l2 * sum(weights) / 2 on the slopes, none on the bias: at the optimum the
    # gradient of that loss is zero.
    l2 = 1e-2
    ridged = fit_logistic(x, y, l2=l2, weights=counts)
    p = 1 / (1 + np.exp(-(x @ ridged.weights)))
    grad = x.T @ (counts * (p - y)) + l2 * counts.sum() * np.r_[0.0, ridged.weights[1:]]
    assert np.abs(grad).max() < 1e-6 * counts.sum()
    # Stopped short, a fit says so.
    short = fit_logistic(x, y, l2=l2, weights=counts, max_iter=1)
    assert not short.converged and short.note


def test_a_fit_without_an_optimum_warns_and_says_so_in_the_report():
    """Greedy labels all 1 (every draft token accepted): the bias has no finite optimum."""
    rng = np.random.default_rng(2)
    traces = [
        AcceptanceTrace(f"p{i}", 0.0, rng.uniform(size=(20, W - 2)), np.ones(20), np.ones((20, 2)))
        for i in range(4)
    ]
    with pytest.warns(RuntimeWarning) as caught:
        model, report = fit_acceptance(traces, [4.0], heldout_every=5, hidden=False)
    assert any("fit greedy/current did not converge" in str(w.message) for w in caught)
    assert report["greedy"]["convergence"]["current"]["converged"] is False
    assert model.modes["greedy"].current[0] > 10  # P(accept) near 1, finite


def test_recent_acceptance_only_looks_back():
    stats = np.zeros((4, W - 2))
    trace = AcceptanceTrace("p", 0.0, stats, np.array([1.0, 0.0, 1.0, 1.0]))
    x, y, w = design([trace], decay=0.5, prior=0.6, shift=0)
    assert x[:, -1] == pytest.approx([0.6, 0.8, 0.4, 0.7])  # before each position's own label
    assert y.tolist() == [1.0, 0.0, 1.0, 1.0] and w.tolist() == [1.0] * 4
    x, y, w = design([trace], decay=0.5, prior=0.6, shift=1)  # `next`: position i's features
    assert len(x) == 3 and y.tolist() == [0.0, 1.0, 1.0]
    assert w.tolist() == [1.0, 0.0, 1.0]  # given position i accepted: after a miss, weight 0


def _model(**kw) -> AcceptanceModel:
    mode = ModeModel([0.0] * W, [0.0] * W, 0.7, [0.1, 0.2], [0.3, 0.7, 0.9])
    return AcceptanceModel({"greedy": mode}, [4.0, 6.0, 7.0], **kw)


def test_saved_model_round_trips_and_stale_files_are_refused(tmp_path):
    path = tmp_path / "acceptance.json"
    model = _model(meta={"pair": {"draft_model": "d"}})
    model.save(path)
    back = AcceptanceModel.load(path)
    assert back == model
    assert back.union(2) == 6.0 and back.union(9) == 7.0  # the last value beyond the table
    raw = json.loads(path.read_text())
    raw["feature_names"] = ["bias", "conf"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="features .* differ"):
        AcceptanceModel.load(path)
    with pytest.raises(FileNotFoundError, match="jobs.train_acceptance"):
        AcceptanceModel.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no sampled part"):
        model.mode(greedy=False)


def test_spread_adds_the_recent_acceptance_term_to_each_percentile():
    w = [0.0] * (W - 1) + [2.0]  # recent's weight 2
    mode = ModeModel(w, w, 0.7, [], [-1.0, 0.0, 1.0])
    low, high = mode.spread_around(0.1), mode.spread_around(0.9)
    assert low == pytest.approx([1 / (1 + np.exp(-(z + 0.2))) for z in (-1.0, 0.0, 1.0)])
    assert all(a < b for a, b in zip(low, high, strict=True)) and low == sorted(low)
    assert ModeModel(w, w, 0.7).spread_around(0.5) == pytest.approx([1 / (1 + np.exp(-1.0))])
    for m, recent in ((mode, 0.1), (mode, 0.9), (ModeModel(w, w, 0.7), 0.5)):
        assert m.spread_floor(recent) == pytest.approx(min(m.spread_around(recent)))


@pytest.fixture(scope="module")
def pair():
    from pipeline.models.loading import load_pair

    return load_pair()


PROMPT = Prompt("t-0", "code", "def add(a, b):\n    return", "test")


def test_greedy_trace_labels_are_argmax_matches_on_the_target_text(pair):
    trace, unions = trace_prompt(pair, PROMPT, SamplingConfig(), 12, seed=0, max_m=4)
    assert len(trace.labels) == 12 and set(trace.labels.tolist()) <= {0.0, 1.0}
    assert trace.hidden.shape == (12, pair.draft.config.hidden_size)
    assert 0 < trace.labels.mean() <= 1  # the embedded draft agrees often
    means = unions.means()
    assert means[0] == pytest.approx(pair.spec.top_k)  # one position: exactly top-k experts
    assert means == sorted(means)  # unions grow with the window


def test_sampled_trace_labels_are_acceptance_probabilities(pair, monkeypatch):
    """The label of position i is sum_x min(p_i(x), q_i(x)): the probability that sampled
    verification accepts a token drawn from q_i, with p_i, q_i the target's and the draft's
    distributions at T given the prompt and the first i generated tokens."""
    import pipeline.acceptance.traces as traces_module
    from pipeline.acceptance.traces import prompt_ids

    generated: list[list[int]] = []

    class Recording(traces_module.SpeculativeEngine):
        def generate(self, *args, **kwargs):
            gen = super().generate(*args, **kwargs)
            generated.append(list(gen.tokens))
            return gen

    monkeypatch.setattr(traces_module, "SpeculativeEngine", Recording)
    temperature = 0.7
    trace, _ = trace_prompt(
        pair, PROMPT, SamplingConfig(temperature=temperature), 12, seed=0, max_m=2
    )
    (tokens,) = generated
    ids = prompt_ids(pair, PROMPT)
    full = torch.tensor([ids + tokens], device=pair.device)
    rows = slice(len(ids) - 1, len(ids) - 1 + len(tokens))  # logits there predict tokens[i]
    with torch.no_grad():
        p = torch.softmax(pair.target(full).logits[0, rows].double() / temperature, dim=-1)
        q = torch.softmax(pair.draft(full).logits[0, rows].double() / temperature, dim=-1)
    expected = torch.minimum(p, q).sum(-1).cpu().numpy()
    assert len(trace.labels) == len(tokens) == 12
    assert trace.labels == pytest.approx(expected, abs=1e-5)
    # The same number as one minus the total variation distance, and strictly inside (0, 1).
    tv = 0.5 * (p - q).abs().sum(-1).cpu().numpy()
    assert trace.labels == pytest.approx(1 - tv, abs=1e-5)
    assert ((trace.labels > 0) & (trace.labels < 1)).all()


def test_fit_reports_held_out_scores_against_raw_confidence():
    rng = np.random.default_rng(1)
    traces = []
    for i in range(10):
        conf = rng.uniform(0.05, 1.0, 200)
        stats = np.column_stack([np.log(conf), conf, 2 - 2 * conf, conf / 2, np.zeros((200, 3))])
        labels = (rng.uniform(size=200) < 0.3 + 0.6 * conf).astype(float)
        traces.append(AcceptanceTrace(f"p{i}", 0.0, stats, labels, rng.normal(size=(200, 3))))
    model, report = fit_acceptance(traces, [4.0, 6.0], heldout_every=5)
    scores = report["greedy"]["current"]
    assert scores["log_loss"] < scores["log_loss_constant"]
    assert len(model.modes["greedy"].head) == 4 and len(model.modes["greedy"].spread) == 10
    assert "sampled" not in model.modes


@pytest.mark.slow
def test_train_acceptance_job_end_to_end(tmp_path):
    from jobs.train_acceptance import main

    out = tmp_path / "acceptance.json"
    report = main(
        [
            "--per-domain",
            "1",
            "--max-new-tokens",
            "8",
            "--temperatures",
            "0,1",
            "--max-m",
            "3",
            "--out",
            str(out),
        ]
    )
    model = AcceptanceModel.load(out)
    assert set(model.modes) == {"greedy", "sampled"} and len(model.union_by_m) == 3
    assert model.meta["pair"]["draft_fingerprint"] and set(report) == {"greedy", "sampled"}


def test_saved_traces_carry_their_pair_and_settings(tmp_path):
    from pipeline.acceptance.traces import UnionCounts, load_traces, save_traces

    trace = AcceptanceTrace(
        "p", 1.0, np.zeros((3, W - 2)), np.array([0.5, 0.6, 0.7]), np.ones((3, 2))
    )
    meta = {"pair": {"draft_fingerprint": "sha256:x"}, "temperatures": [1.0]}
    path = tmp_path / "t.npz"
    save_traces(path, [trace], UnionCounts(np.array([4.0, 12.0]), np.array([1.0, 2.0])), meta)
    (back,), unions, meta_back = load_traces(path)
    assert meta_back == meta and unions.means() == [4.0, 6.0]
    assert back.prompt_id == "p" and back.labels.tolist() == [0.5, 0.6, 0.7]
    assert back.hidden.shape == (3, 2)


def test_traces_of_an_older_feature_set_are_refused(tmp_path):
    from pipeline.acceptance.traces import UnionCounts, load_traces, save_traces

    old = AcceptanceTrace("p", 0.0, np.zeros((3, 4)), np.array([1.0, 0.0, 1.0]), np.ones((3, 2)))
    path = tmp_path / "old.npz"
    save_traces(path, [old], UnionCounts(np.array([4.0]), np.array([1.0])), {})
    with pytest.raises(ValueError, match="remove the file"):
        load_traces(path)
