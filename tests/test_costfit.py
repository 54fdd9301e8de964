"""The cost-model fit recovers known coefficients from synthetic rounds."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipeline.cost.fit import fit_cost_model
from pipeline.cost.model import CostModel, select_mode
from pipeline.cost.modes import fit_modes

TRUE_BETA0 = {1: 5.0, 2: 5.5, 3: 6.0, 4: 6.2, 5: 4.0, 6: 4.3}
TRUE_ALPHA = {1: 0.0, 2: 0.08, 3: 0.08, 4: 0.09, 5: 0.26, 6: 0.27}
TRUE_C, DRAFT_A, DRAFT_B = 0.0011, 0.46, 0.07


def synthetic_rounds(
    seed: int = 0, generations: int = 40, look_ks: tuple[int, ...] = ()
) -> pd.DataFrame:
    """Rounds timed by the model itself plus noise; K in ``look_ks`` also gets look rounds
    (K tokens, K + 1 draft forwards: the draft time of K + 1, the target time of m = K + 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    kinds = [(k, False) for k in range(6)] + [(k, True) for k in look_ks]
    for g in range(generations):
        gen_effect = rng.normal(0, 0.02)  # rounds of one generation share a little noise
        for k, look in kinds:
            m = k + 1
            forwards = k + 1 if look else k
            for r in range(12):
                u = 4.0 if m == 1 else rng.uniform(4, 4 + 3 * m)
                ctx = 100 + 20 * r + rng.integers(0, 50)
                t = TRUE_BETA0[m] + TRUE_ALPHA[m] * u + TRUE_C * ctx + gen_effect
                t_draft = DRAFT_A * forwards + DRAFT_B + rng.normal(0, 0.02) if forwards else 0.0
                rows.append(
                    {
                        "gen_id": f"g{g}|K{k}" + ("+look" if look else ""),
                        "category": "x",
                        "k": k,
                        "m": m,
                        "t_target_ms": t + rng.normal(0, 0.03),
                        "t_draft_ms": t_draft,
                        "draft_forwards": forwards,
                        "u_bar": u,
                        "ctx_len": ctx,
                        "kv_tokens": ctx - 1,
                        "kv_occupancy": (ctx - 1) / 2048,
                        "accepted": rng.integers(0, k + 1),
                        "round": r,
                    }
                )
    return pd.DataFrame(rows)


def test_interference_spikes_are_dropped_before_the_fit():
    rounds = synthetic_rounds()
    spikes = rounds.sample(40, random_state=0).index
    rounds.loc[spikes, "t_target_ms"] += 500.0  # another process stole the CPU
    fit = fit_cost_model(rounds)
    assert fit.model.meta["fit"]["rounds_dropped_as_interference"] == 40
    assert any("interference" in note for note in fit.notes)
    for m in TRUE_BETA0:
        assert fit.model.beta0[m] == pytest.approx(TRUE_BETA0[m], abs=0.05), m


def test_fit_recovers_known_coefficients(tmp_path):
    fit = fit_cost_model(synthetic_rounds(), meta={"device": "synthetic"})
    model = fit.model
    for m in TRUE_BETA0:
        assert model.beta0[m] == pytest.approx(TRUE_BETA0[m], abs=0.05), m
        assert model.alpha[m] == pytest.approx(TRUE_ALPHA[m], abs=0.005), m
    assert model.c == pytest.approx(TRUE_C, rel=0.1)
    assert model.draft_a == pytest.approx(DRAFT_A, abs=0.01)
    assert model.draft_b == pytest.approx(DRAFT_B, abs=0.02)
    per_m = fit.per_m.set_index("m")
    assert (per_m.loc[2:, "alpha_p"] < 1e-3).all()
    assert (per_m["oos_mape"] < 2.0).all()
    factors = fit.factors.set_index("factor")
    assert {"u_bar", "ctx_len", "m", "accepted"} <= set(factors.index)
    assert factors.loc["u_bar", "oos_r2"] > 0.5
    # Context carries information U lacks: adding it to U lowers the held-out error.
    assert factors.loc["ctx_len", "rmse_reduction_ms"] > 0
    assert fit.notes and "m=1" in fit.notes[0]
    path = tmp_path / "costmodel.json"
    model.save(path)
    data = json.loads(path.read_text())
    assert {"beta0", "alpha", "c", "draft", "device", "fit"} <= data.keys()
    again = CostModel.load(path)
    assert again.t_target(3, 10.0, 500) == pytest.approx(model.t_target(3, 10.0, 500))
    assert again.t_draft(4) == pytest.approx(DRAFT_A * 4 + DRAFT_B, abs=0.05)
    with pytest.raises(KeyError, match="m = 9"):
        again.t_target(9, 10.0, 500)


def test_fit_rejects_unusable_input():
    with pytest.raises(ValueError, match="lacks columns"):
        fit_cost_model(pd.DataFrame({"k": [1]}))
    one_gen = synthetic_rounds(generations=1)
    one_gen["gen_id"] = "only"
    with pytest.raises(ValueError, match="at least 2 generations"):
        fit_cost_model(one_gen)


def test_draft_line_is_fitted_on_forwards_pooled_over_fixed_and_look_rounds():
    """Look rounds (K tokens, K + 1 forwards; K = 0: one forward and no token) are priced by the
    same line as fixed chains once it is read on forwards; read on K they would sit a whole
    forward (about a = 0.46 ms) above it."""
    rounds = synthetic_rounds(look_ks=(0, 2, 5))
    fit = fit_cost_model(rounds)
    model = fit.model
    assert model.draft_a == pytest.approx(DRAFT_A, abs=0.01)
    assert model.draft_b == pytest.approx(DRAFT_B, abs=0.02)
    for n in range(1, 7):
        assert model.t_draft(n) == pytest.approx(DRAFT_A * n + DRAFT_B, abs=0.03)
    assert model.t_draft(0) == 0.0
    quality = model.meta["fit"]["draft"]
    assert quality["rounds_look"] == 40 * 3 * 12 and quality["rounds_fixed"] == 40 * 5 * 12
    assert quality["oos_mape_look_pct"] < 2.0 and quality["oos_mape_fixed_pct"] < 2.0
    assert quality["oos_r2"] > 0.99
    # A look does not change m: T_T keeps its per-m fit (looks add rows to m = K + 1).
    for m in TRUE_BETA0:
        assert model.beta0[m] == pytest.approx(TRUE_BETA0[m], abs=0.05), m
        assert model.alpha[m] == pytest.approx(TRUE_ALPHA[m], abs=0.005), m
    # The one-forward look at K = 0 is not dropped as interference beside the K = 0 AR rounds.
    assert model.meta["fit"]["rounds_dropped_as_interference"] == 0
    # The wrong reading (T_D on K) would misprice the looks by a forward: the fit must not.
    on_k = np.polyfit(
        rounds.loc[rounds["k"] > 0, "k"], rounds.loc[rounds["k"] > 0, "t_draft_ms"], 1
    )
    assert abs(on_k[0] - DRAFT_A) > 0.02 or abs(on_k[1] - DRAFT_B) > 0.05


def test_rounds_from_before_looks_are_read_as_fixed_chains():
    old = synthetic_rounds().drop(columns=["draft_forwards"])
    fit = fit_cost_model(old)
    assert fit.model.draft_a == pytest.approx(DRAFT_A, abs=0.01)
    assert fit.model.meta["fit"]["draft"]["rounds_look"] == 0
    assert any("without draft_forwards" in note for note in fit.notes)


# Per decoding mode: draft line (a, b) and acceptance walk (a per position, b), ms.
MODE_PRICES = {0.0: ((DRAFT_A, DRAFT_B), (0.01, 0.02)), 1.0: ((0.55, 0.09), (0.20, 0.10))}


def test_each_decoding_mode_gets_its_draft_and_acceptance_walk_prices():
    """Rounds of two modes: the file's own line is the first mode's, and `modes` recovers
    each mode's draft line and walk, which for_sampling then prices with."""
    frames = []
    for seed, (temperature, ((a, b), (wa, wb))) in enumerate(MODE_PRICES.items()):
        df = synthetic_rounds(seed=seed, generations=20)
        rng = np.random.default_rng(seed)
        drafting = df["draft_forwards"] > 0
        noise = rng.normal(0, 0.02, len(df))
        df["t_draft_ms"] = np.where(drafting, a * df["draft_forwards"] + b + noise, 0.0)
        df["t_accept_ms"] = wa * df["m"] + wb + rng.normal(0, 0.005, len(df))
        df["temperature"] = temperature
        df["gen_id"] += f"|T{temperature:g}"
        frames.append(df)
    rounds = pd.concat(frames, ignore_index=True)
    model = fit_cost_model(rounds, draft_rounds=frames[0]).model
    assert model.draft_a == pytest.approx(DRAFT_A, abs=0.01)
    modes = fit_modes(rounds, model, top_p=0.9)
    assert [(e["temperature"], e["top_p"]) for e in modes] == [(0.0, 1.0), (1.0, 0.9)]
    for entry, ((a, b), (wa, wb)) in zip(modes, MODE_PRICES.values(), strict=True):
        assert entry["draft"]["a"] == pytest.approx(a, abs=0.01)
        assert entry["draft"]["b"] == pytest.approx(b, abs=0.03)
        assert entry["accept"]["a"] == pytest.approx(wa, abs=0.005)
        assert entry["accept"]["b"] == pytest.approx(wb, abs=0.02)
        assert abs(entry["error"]["verify_bias_pct"]) < 1
        assert abs(entry["error"]["draft_bias_pct"]) < 1
    model.meta["modes"] = modes
    model = CostModel.from_json(json.loads(json.dumps(model.to_json())))  # as saved
    for temperature, top_p, entry in [(0.0, 1.0, modes[0]), (0.7, 1.0, modes[1])]:
        priced = model.for_sampling(temperature, top_p)
        assert priced.draft_a == entry["draft"]["a"] and priced.draft_b == entry["draft"]["b"]
        walk = entry["accept"]["a"] * 5 + entry["accept"]["b"]
        assert priced.t_target(5, 9.0, 200) == pytest.approx(model.t_target(5, 9.0, 200) + walk)
        assert priced.meta["priced_mode"]["temperature"] == entry["temperature"]
    # A file calibrated greedy only prices a sampled generation as it is.
    model.meta["modes"] = modes[:1]
    assert model.for_sampling(1.0) is model


def test_a_sampled_generation_reads_the_nearest_mode_of_its_kind():
    modes = [
        {"temperature": 0.0, "top_p": 1.0},
        {"temperature": 0.7, "top_p": 1.0},
        {"temperature": 1.0, "top_p": 1.0},
        {"temperature": 1.0, "top_p": 0.9},
    ]
    assert select_mode(modes, 0.0, 1.0) is modes[0]
    assert select_mode(modes, 0.8, 1.0) is modes[1]  # nearest temperature
    assert select_mode(modes, 1.3, 1.0) is modes[2]
    assert select_mode(modes, 0.6, 0.95) is modes[3]  # a nucleus: the mode with one
    assert select_mode(modes[:3], 0.6, 0.95) is modes[1]  # none with one: the nearest
    assert select_mode(modes[1:], 0.0, 1.0) is None and select_mode(modes[:1], 1.0, 1.0) is None
