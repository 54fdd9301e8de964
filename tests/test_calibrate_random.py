"""Real-shape MoE with random weights: layouts, parameter counts without allocating, the
memory guard, and the designed-calibration job on a scaled-down layout (CPU, seconds)."""

from __future__ import annotations

import json

import pandas as pd
import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

from jobs import calibrate_random
from pipeline.cost.designed import union_levels
from pipeline.cost.random_target import ARTIFACTS
from pipeline.models import random_moe
from pipeline.models.adapters import NoMoELayersError, moe_spec
from pipeline.models.random_moe import (
    ModelTooLargeError,
    build_random_moe,
    layout_config,
    parameter_count,
)

# A tiny Qwen3-MoE: 2 layers x 8 experts, top-2, hidden 64, vocab 512.
TINY = dict(
    num_hidden_layers=2,
    num_experts=8,
    num_experts_per_tok=2,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)
TINY_FLAGS = (
    "--layers 2 --experts 8 --top-k 2 --hidden 64 --intermediate 128 "
    "--moe-intermediate 32 --heads 4 --kv-heads 2 --head-dim 16 --vocab 512"
)


def test_full_qwen3_30b_a3b_layout_is_counted_without_allocating():
    config = layout_config("qwen3-30b-a3b")
    spec = moe_spec(config)
    assert (spec.num_moe_layers, spec.num_experts, spec.top_k) == (48, 128, 8)
    assert config.head_dim == 128 and config.rope_parameters["rope_theta"] == 1e6
    rss = psutil.Process().memory_info().rss
    count = parameter_count(config)
    assert 29e9 <= count <= 32e9  # ~30.5e9: 61 GB in bf16, which would not fit here
    assert psutil.Process().memory_info().rss - rss < 2**30


def test_overrides_scale_the_layout_down():
    full = parameter_count(layout_config("qwen3-30b-a3b"))
    two = layout_config("qwen3-30b-a3b", num_hidden_layers=2, num_experts=16)
    four = layout_config("qwen3-30b-a3b", num_hidden_layers=4, num_experts=16)
    assert moe_spec(two).moe_layers == (0, 1) and two.num_experts == 16
    assert two.num_experts_per_tok == 8 and two.hidden_size == 2048  # the rest is kept
    per_layer = (parameter_count(four) - parameter_count(two)) / 2
    # embeddings + lm_head (2 x 151936 x 2048) are the same; experts are 16 x 3 x 2048 x 768
    assert parameter_count(two) == pytest.approx(2 * 151936 * 2048 + 2 * per_layer, rel=1e-3)
    assert per_layer < full / 48


def test_unknown_or_inconsistent_overrides_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown qwen3_moe config field.*num_expertz"):
        layout_config("qwen3-30b-a3b", num_expertz=4)
    with pytest.raises(ValueError, match="top_k 8.*exceeds the 4 experts"):
        layout_config("qwen3-30b-a3b", num_experts=4)
    with pytest.raises(ValueError, match="unknown layout"):
        layout_config("no-such-layout")
    with pytest.raises(NoMoELayersError):
        layout_config("qwen3-30b-a3b", num_hidden_layers=2, mlp_only_layers=[0, 1])
    # a local config.json works as a layout, overrides included
    path = tmp_path / "config.json"
    path.write_text(json.dumps(layout_config("qwen3-30b-a3b", **TINY).to_dict()))
    assert parameter_count(layout_config(path)) == parameter_count(layout_config(tmp_path))
    assert layout_config(path, num_hidden_layers=3).num_hidden_layers == 3


def test_the_memory_guard_refuses_before_allocating(monkeypatch):
    monkeypatch.setattr(random_moe, "available_memory", lambda device: (2**30, "test"))
    with pytest.raises(ModelTooLargeError) as exc:
        build_random_moe(layout_config("qwen3-30b-a3b"), "cpu", torch.bfloat16)
    message = str(exc.value)
    assert "30.53e9 parameters" in message and "56.9 GiB" in message and "1.0 GiB free" in message
    assert "--layers" in message and "--experts" in message
    # the job fails the same way, before any model is built
    with pytest.raises(ModelTooLargeError):
        calibrate_random.main(["--device", "cpu", "--dtype", "bfloat16"])
    model = build_random_moe(layout_config("qwen3-30b-a3b", **TINY), "cpu", torch.float32)
    assert not model.training and next(model.parameters()).dtype == torch.float32


def test_random_weights_are_seeded_and_on_the_requested_device():
    config = layout_config("qwen3-30b-a3b", **TINY)
    dtype_before = config.dtype
    a = build_random_moe(config, "cpu", torch.float32, seed=3)
    b = build_random_moe(config, "cpu", torch.float32, seed=3)
    experts = a.model.layers[0].mlp.experts
    assert experts.gate_up_proj.device.type == "cpu" and experts.gate_up_proj.std() > 0
    assert torch.equal(experts.gate_up_proj, b.model.layers[0].mlp.experts.gate_up_proj)
    assert config.dtype == dtype_before  # the caller's config is not mutated
    with pytest.raises(ValueError, match="experts implementation"):
        build_random_moe(config, "cpu", torch.float32, experts_implementation="fast")


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_job_runs_the_designed_calibration_on_a_scaled_down_layout(
    tmp_path, monkeypatch, capsys, restore_threads
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cal"
    args = (
        f"{TINY_FLAGS} --device cpu --threads 1 --ms 1-3 --contexts 16,32 --per-length 3 "
        f"--repeats 2 --max-levels 3 --out {out}"
    )
    got = calibrate_random.main(args.split())
    printed = capsys.readouterr().out
    for name in ARTIFACTS:
        assert (out / name).is_file(), name
    assert "ETA" in printed and "paper alpha" in printed and "NOT like with like" in printed

    # every pass computed its forced union (collect_designed_rounds raises otherwise), and
    # every (context, m, U) cell ran its repeats
    rounds = pd.read_parquet(out / "designed_rounds.parquet")
    for m in (1, 2, 3):
        levels = union_levels(m, 2, 8, 3)
        assert sorted(rounds.loc[rounds["m"] == m, "u_bar"].unique()) == levels
    assert len(rounds) == 6 * 2 * sum(len(union_levels(m, 2, 8, 3)) for m in (1, 2, 3))
    assert sorted(rounds["ctx_len"].unique()) == [16, 32]

    fit = json.loads((out / "target_fit.json").read_text())
    assert set(fit["alpha"]) == set(fit["beta0"]) == {"1", "2", "3"}
    assert all(fit["beta0"][m] is not None for m in ("1", "2", "3"))
    assert fit["per_m"]["2"]["alpha_se"] is not None and fit["per_m"]["1"]["alpha_se"] is None
    comparison = fit["paper_comparison"]
    assert not comparison["comparable"] and [r["paper_alpha"] for r in comparison["per_m"]] == [
        0.08,
        0.08,
        0.08,
    ]
    meta = fit["meta"]
    assert meta["parameters"] == parameter_count(layout_config("qwen3-30b-a3b", **TINY))
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["torch_threads"] == 1
    assert meta["experts_implementation"] == "eager" and meta["weights"] == "random"
    assert set(pd.read_csv(out / "fit_per_m.csv")["m"]) == {1, 2, 3}
    assert len(pd.read_csv(out / "cells.csv")) == 7

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(got["run_id"])
    assert run.info.status == "FINISHED" and "alpha_m2" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(got["run_id"])}
    assert set(ARTIFACTS) <= artifacts


@pytest.mark.parametrize(
    "args, message",
    [
        ("--ms 0-3", "--ms must be >= 1"),
        ("--contexts 1,16", "--contexts must be lengths >= 2"),
        ("--contexts a,b", "not comma-separated integers"),
        ("--max-levels 1", "--max-levels must be >= 2"),
        ("--experts 0", "--experts must be >= 1"),
        ("--set nofield", "expected FIELD=VALUE"),
    ],
)
def test_job_arguments_are_checked(args, message, capsys):
    with pytest.raises(SystemExit):
        calibrate_random.parse_args(args.split())
    assert message in capsys.readouterr().err


def test_only_the_full_layout_in_bf16_with_grouped_mm_on_an_a100_is_the_papers_setting():
    from pipeline.cost.random_target import differences_from_paper

    full = random_moe.layout_config("qwen3-30b-a3b")
    a100 = (torch.device("cuda"), torch.bfloat16, "NVIDIA A100-SXM4-80GB")
    assert differences_from_paper(full, *a100, "grouped_mm") == []
    (kernel,) = differences_from_paper(full, *a100, "eager")
    assert "experts kernel eager" in kernel
    assert (
        len(differences_from_paper(full, torch.device("cpu"), torch.float32, "x86_64", "eager"))
        == 3
    )
