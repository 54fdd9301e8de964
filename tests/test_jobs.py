"""The command-line jobs, run for real on the embedded models (slow: end to end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, REPO_ROOT
from pipeline.tiny.build import MAX_MODELS_BYTES
from pipeline.tiny.eagle3_training import MAX_HEAD_BYTES
from pipeline.tiny.second_draft import MAX_DRAFT_BYTES
from pipeline.tiny.training import directory_size_bytes


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def _run(args, cwd, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_embedded_models_are_committed_and_small():
    assert (DEFAULT_TARGET / "config.json").is_file()
    assert (DEFAULT_DRAFT / "tokenizer.json").is_file()
    models = REPO_ROOT / "models"
    second = models / "draft-2layer"  # the second pair's draft and its artifacts
    head = models / "eagle3-head"  # the EAGLE-3 head and its artifacts
    # The embedded pair and its artifacts within train_tiny's budget, each other draft within
    # the budget its trainer enforces (models/ stays under 40 MiB).
    pair = directory_size_bytes(models) - directory_size_bytes(second) - directory_size_bytes(head)
    assert pair <= MAX_MODELS_BYTES
    assert directory_size_bytes(second) <= MAX_DRAFT_BYTES
    assert directory_size_bytes(head) <= MAX_HEAD_BYTES
    assert (head / "config.json").is_file() and (head / "acceptance.json").is_file()
    assert (second / "config.json").is_file() and (second / "acceptance.json").is_file()
    report = json.loads((REPO_ROOT / "models" / "train_report.json").read_text())
    assert {"target_heldout_loss", "draft_target_top1_agreement"} <= report.keys()


@pytest.mark.slow
def test_profile_routing_job_end_to_end(tmp_path):
    proc = _run(
        ["jobs.profile_routing", "--limit", "3", "--max-new-tokens", "24", "--out", "prof"],
        cwd=tmp_path,
    )
    assert "mean unique experts/layer" in proc.stdout
    profile = json.loads((tmp_path / "prof" / "routing_profile.json").read_text())
    windows = profile["mean_unique_experts_by_window"]
    assert list(windows) == [str(w) for w in range(1, 9)]
    assert windows["1"] == profile["top_k"]
    assert all(windows[str(w)] <= windows[str(w + 1)] for w in range(1, 8))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("profile_routing").experiment_id])
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["unique_experts_w1"] == profile["top_k"]


def test_profile_routing_job_reports_bad_input_without_traceback(tmp_path, capsys):
    # What `python -m jobs.profile_routing` runs (jobs.cli.run over main), in this process.
    from jobs.cli import run
    from jobs.profile_routing import main

    cases = [
        (["--target", str(tmp_path / "missing")], "does not exist"),
        (["--limit", "0"], "--limit"),
    ]
    for argv, why in cases:
        with pytest.raises(SystemExit) as exit_:
            run(lambda argv=argv: main(argv))
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and why in err and "Traceback" not in err, err[-500:]


@pytest.mark.slow
def test_train_tiny_smoke(tmp_path):
    proc = _run(
        [
            "jobs.train_tiny",
            "--out",
            "m",
            "--target-steps",
            "2",
            "--draft-steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--heldout-tokens",
            "2000",
        ],
        cwd=tmp_path,
    )
    assert "draft top-1 agreement" in proc.stdout
    report = json.loads((tmp_path / "m" / "train_report.json").read_text())
    assert report["target_params"] > report["draft_params"]
    assert (tmp_path / "m" / "target" / "model.safetensors").is_file()


@pytest.mark.slow
def test_train_tiny_second_draft_smoke(tmp_path):
    """--draft-for distils only a draft, of another depth, for an existing target."""
    proc = _run(
        [
            "jobs.train_tiny",
            "--draft-for",
            str(DEFAULT_TARGET),
            "--draft-layers",
            "2",
            "--out",
            "d2",
            "--draft-steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--heldout-tokens",
            "2000",
        ],
        cwd=tmp_path,
    )
    assert "2-layer draft" in proc.stdout
    config = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert (tmp_path / "d2" / "tokenizer.json").is_file()
    missing = _run(
        ["jobs.train_tiny", "--draft-for", "nowhere", "--out", "d3"], tmp_path, check=False
    )
    assert missing.returncode != 0 and "no target checkpoint at nowhere" in missing.stderr


@pytest.mark.slow
def test_train_tiny_head_smoke(tmp_path):
    """--head-for trains only an EAGLE-3 head, on stdlib and ShareGPT windows, that loads."""
    from pipeline.models.eagle3_formats import head_format, read_config

    proc = _run(
        [
            "jobs.train_tiny",
            "--head-for",
            str(DEFAULT_TARGET),
            "--out",
            "h",
            "--head-windows",
            "32",
            "--head-steps",
            "2",
            "--ttt-steps",
            "2",
            "--head-sharegpt-fraction",
            "0.5",
        ],
        cwd=tmp_path,
    )
    assert "EAGLE-3 head" in proc.stdout
    report = json.loads((tmp_path / "h" / "train_report.json").read_text())
    assert report["sharegpt_windows"] == 16 and report["windows"] == 32
    for key in ("heldout_top1_agreement_by_step", "heldout_sharegpt_top1_agreement_by_step"):
        assert len(report[key]) == 2 and all(0.0 <= a <= 1.0 for a in report[key])
    assert head_format(tmp_path / "h") == "specforge"
    cfg, _ = read_config(tmp_path / "h")
    assert cfg.verifier_name == str(DEFAULT_TARGET)


@pytest.mark.slow
def test_study_end_to_end_small(tmp_path):
    args = "--limit 3 --max-new-tokens 24 --lmax 4 --calibration-prompts 2 "
    args += "--calibration-tokens 12 --num-cpus 2 --out study"
    proc = _run(["jobs.study", *args.split()], cwd=tmp_path)
    for text in (
        "routing profile",
        "Lmax sweep",
        "boundary slope lambda",
        "study done",
        "tree bound beside the chain bound",
        "tree bound at K = 4 (T = 0): chain",
    ):
        assert text in proc.stdout, text
    out = tmp_path / "study"
    for path in (
        "extract/manifest.json",
        "calibration/costmodel.json",
        "oracle/decisions.parquet",
        "oracle/summary.parquet",
        "oracle/policy.json",
        "oracle/tree_bound.csv",
    ):
        assert (out / path).is_file(), path
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for experiment in ("extract", "profile_routing", "calibrate", "oracle"):
        exp = client.get_experiment_by_name(experiment)
        assert exp is not None, experiment
        runs = client.search_runs([exp.experiment_id])
        assert runs and runs[0].info.status == "FINISHED", experiment


@pytest.mark.slow
def test_bench_online_smoke(tmp_path):
    proc = _run(
        ["jobs.bench_online", "--limit", "1", "--max-new-tokens", "6", "--temperatures", "0,1"],
        cwd=tmp_path,
    )
    for text in (
        "transformers assisted",
        "tree(depth=3",
        "ecospec(depth=3",
        "ecospec-global",
        "marginal",
        "oracle-replay (k*)",
        "of bound",
        "of replay",
        "oracle replay, prompt 0",
    ):
        assert text in proc.stdout, text
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bench_online")
    metrics = client.search_runs([exp.experiment_id])[0].data.metrics
    # Like for like at T = 0: greedy acceptance and greedy junk tails price exactly what greedy
    # decoding verifies, and every chain policy's k is an action of the DP (looks only add
    # draft forwards), so no chain policy's modelled speedup exceeds the bound on its own text
    # (0.5%: the router's top-k may break a near-tie differently in a batched pass).
    of_bound = {k: v for k, v in metrics.items() if k.endswith("_T0_of_bound")}
    assert {"ar_T0_of_bound", "fixed_k_2_T0_of_bound", "marginal_T0_of_bound"} <= of_bound.keys()
    assert all(v <= 1.005 for v in of_bound.values()), of_bound
    assert not any(k.startswith(("tree", "ecospec")) for k in of_bound)  # no chain bound
    assert metrics["ar_T0_of_bound"] == pytest.approx(1 / metrics["ar_T0_bound"], rel=1e-9)


@pytest.mark.slow
def test_train_predictor_job_end_to_end(tmp_path):
    _run(
        [
            "jobs.extract",
            "--limit",
            "3",
            "--lmax",
            "1",
            "--max-new-tokens",
            "16",
            "--num-cpus",
            "2",
            "--out",
            "traces",
        ],
        cwd=tmp_path,
    )
    proc = _run(
        ["jobs.train_predictor", "--extract", "traces", "--epochs", "2", "--out", "pred"],
        cwd=tmp_path,
    )
    assert "held-out top-4 overlap accuracy" in proc.stdout and "x a draft step" in proc.stdout
    report = json.loads((tmp_path / "pred" / "train_report.json").read_text())
    assert (tmp_path / "pred" / "predictor.safetensors").is_file()
    _check_predictor_report(report, tmp_path / "traces", tmp_path / "pred")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("train_predictor").experiment_id])
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["held_out_topk_overlap"] == report["held_out_topk_overlap"]


def _check_predictor_report(report: dict, traces: Path, saved: Path) -> None:
    """The report against a direct computation: the saved predictor on the job's held-out
    split (its defaults: 20% of the sequences, seed 0) hits, counted set by set here, the
    reported share of the router's top-k experts; the cost ratio is the two reported times'
    ratio. Tolerance: one expert hit, for float noise between the job's process and this one
    (the draft contexts are recomputed here, on the device the job used)."""
    import torch

    from pipeline.models.loading import load_pair
    from pipeline.predictor.model import LearnedExpertPredictor
    from pipeline.predictor.training import load_samples, split_by_sequence

    pair = load_pair(device=report["device"])
    train_set, test_set = split_by_sequence(load_samples(traces, pair, pair.spec), 0.2, 0)
    assert (report["train_tokens"], report["held_out_tokens"]) == (len(train_set), len(test_set))
    predictor = LearnedExpertPredictor.load(saved)
    predicted = predictor.predict_many(
        test_set.tokens.tolist(), list(torch.from_numpy(test_set.contexts))
    )
    hits = sum(
        len(set(p.tolist()) & set(a.tolist()))
        for p_layers, a_layers in zip(predicted, test_set.experts, strict=True)
        for p, a in zip(p_layers, a_layers, strict=True)
    )
    slots = test_set.experts.size  # tokens x MoE layers x top_k
    assert report["held_out_topk_overlap"] == pytest.approx(hits / slots, abs=1 / slots)
    assert report["predictor_ms"] > 0 and report["draft_step_ms"] > 0
    assert report["cost_ratio"] == pytest.approx(report["predictor_ms"] / report["draft_step_ms"])


def test_train_predictor_job_reports_a_missing_extraction(tmp_path):
    proc = _run(["jobs.train_predictor", "--extract", "nowhere"], tmp_path, check=False)
    assert proc.returncode == 2 and "holds no extraction" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("job", "required"),
    [
        ("bench_extract", []),
        ("bench_online", []),
        ("bench_serve", []),
        ("calibrate", []),
        ("extract", []),
        ("profile_routing", []),
        ("study", []),
        ("bench_tree", []),
        ("train_predictor", ["--extract", "{tmp}"]),
    ],
)
def test_every_job_that_loads_models_takes_the_experts_implementation(job, required, tmp_path):
    """A cost model is bound to the experts kernel it timed, so every job that loads the
    models says which one it runs."""
    import importlib

    (tmp_path / "tokens").mkdir()  # what train_predictor checks its extraction for
    module = importlib.import_module(f"jobs.{job}")
    required = [a.format(tmp=tmp_path) for a in required]
    args = module.parse_args([*required, "--experts-implementation", "grouped_mm"])
    assert args.experts_implementation == "grouped_mm"


# The options many jobs share: defined once, in jobs/cli.py (add_*_arg helpers), never by a job.
COMMON_FLAGS = (
    "--target",
    "--draft",
    "--device",
    "--dtype",
    "--experts-implementation",
    "--source",
    "--limit",
    "--max-new-tokens",
    "--max-tokens",
    "--prompt-tokens",
    "--temperatures",
    "--concurrency",
    "--batch-sizes",
    "--repeats",
    "--threads",
    "--seed",
    "--out",
    "--num-cpus",
    "--predictor",
)


def _flags_defined(path: Path) -> set[str]:
    """The option strings a module passes to add_argument (any parser or group)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found.update(a.value for a in node.args if isinstance(a, ast.Constant))
    return found


def test_the_common_options_are_defined_only_in_the_shared_parser():
    jobs = REPO_ROOT / "jobs"
    assert set(COMMON_FLAGS) <= _flags_defined(jobs / "cli.py")
    for path in sorted(jobs.glob("*.py")):
        if path.name != "cli.py":
            own = _flags_defined(path) & set(COMMON_FLAGS)
            assert not own, f"{path.name} defines {sorted(own)}: use jobs.cli's add_*_arg"


def test_the_shared_options_keep_each_jobs_defaults():
    from jobs import bench_serve, bench_serve_sweep, bench_vllm, calibrate, extract, train_tiny

    vllm = bench_vllm.parse_args([])
    assert (vllm.temperatures, vllm.concurrency, vllm.limit) == ([0.0, 1.0], [1, 4, 8, 16], 8)
    assert bench_vllm.parse_args(["--temperatures", "1,0,1"]).temperatures == [0.0, 1.0]
    assert (vllm.repeats, vllm.threads, vllm.out) == (3, 1, Path("out/bench_vllm"))
    cal = calibrate.parse_args([])
    assert (cal.temperatures, cal.repeats, cal.threads) == ([0.0], None, None)
    assert calibrate.parse_args(["--temperature", "1,0"]).temperatures == [1.0, 0.0]
    sweep = bench_serve_sweep.parse_args([])
    assert (sweep.source, sweep.limit, sweep.max_tokens) == (["sharegpt", "humaneval"], 32, 64)
    serve = bench_serve.parse_args([])
    assert (serve.source, serve.concurrency, serve.max_tokens, serve.num_cpus) == (
        "humaneval",
        8,
        32,
        None,
    )
    ext = extract.parse_args([])
    assert (ext.limit, ext.threads, ext.seed, ext.target) == (None, 0, 0, str(DEFAULT_TARGET))
    assert train_tiny.parse_args([]).out == Path("models")


def test_policy_specs_parse_names_and_knobs(capsys):
    from jobs.cli import parse_policy_specs

    specs = "ar, fixed:k=2,throughput:max_k=8:rate=3.5,marginal:calibrate=true"
    assert parse_policy_specs(specs) == [
        ("ar", {}),
        ("fixed", {"k": 2}),
        ("throughput", {"max_k": 8, "rate": 3.5}),
        ("marginal", {"calibrate": True}),
    ]
    for bad in ("", "fixed:k", "fixed:=2"):
        with pytest.raises(ValueError):
            parse_policy_specs(bad)
    from jobs.bench_online import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--policies", "fixed:k=0"])
    assert exit_.value.code == 2
    assert "--policies: fixed: k must be >= 1, got 0" in capsys.readouterr().err


def test_second_draft_never_replaces_the_target_or_an_unrelated_directory(tmp_path, capsys):
    from jobs.train_tiny import parse_args

    target = str(DEFAULT_TARGET)
    cases = [
        ([], "needs --out"),
        (["--out", str(DEFAULT_TARGET.parent)], "replace"),
        (["--out", target], "replace"),
        (["--out", str(DEFAULT_DRAFT)], "not a draft"),
    ]
    for extra, why in cases:
        argv = ["--draft-for", target, *extra]
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert why in capsys.readouterr().err, argv
    assert parse_args(["--draft-for", target, "--out", str(tmp_path / "new")]).out.name == "new"
    assert parse_args([]).out.name == "models"


def test_head_training_arguments_are_checked(tmp_path, capsys):
    from jobs.train_tiny import parse_args

    target = str(DEFAULT_TARGET)
    for extra, why in (
        (["--head-windows", "8"], "--head-windows >= 16"),
        (["--head-steps", "0"], "--head-steps and --ttt-steps must be >= 1"),
        (["--head-sharegpt-fraction", "1.5"], "--head-sharegpt-fraction must be in [0, 1]"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--head-for", target, "--out", str(tmp_path / "h"), *extra])
        assert why in capsys.readouterr().err, extra
    args = parse_args(["--head-for", target, "--out", str(tmp_path / "h"), "--head-windows", "64"])
    assert args.head_windows == 64


def test_bench_and_acceptance_arguments_are_checked_before_anything_loads(capsys):
    from jobs.bench_online import parse_args as bench_args
    from jobs.cli import parse_policy_specs
    from jobs.train_acceptance import parse_args as acceptance_args

    for argv in (
        ["--bound-at", "0.5"],
        ["--bound-at", "x"],
        ["--threads", "-1"],
        ["--no-bound", "--bound-at", "0"],
    ):
        with pytest.raises(SystemExit):
            bench_args(argv)
    assert bench_args(["--bound-at", "0"]).bound_at == [0.0]
    with pytest.raises(SystemExit):
        acceptance_args(["--max-new-tokens", "4", "--max-m", "13"])
    assert "--max-m" in capsys.readouterr().err
    with pytest.raises(ValueError, match="given twice"):
        parse_policy_specs("fixed:k=2:k=3")


@pytest.mark.slow
def test_bench_tree_smoke(tmp_path):
    proc = _run(
        [
            "jobs.bench_tree",
            "--limit",
            "1",
            "--max-new-tokens",
            "10",
            "--repeats",
            "1",
            "--budgets",
            "1,2,4",
        ],
        cwd=tmp_path,
    )
    for text in (
        "tree bound beside the chain bound",
        "eagle2-b2",
        "ecospec-b2",
        "chain-or-ecospec-b2",
        "tree(depth=4,branch=2,gamma=9)",
        "eagle2-b2-d4",
        "ecospec-b2-d3",
        "of bound",
        "target token-forwards and",
    ):
        assert text in proc.stdout, text
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bench_tree")
    metrics = client.search_runs([exp.experiment_id])[0].data.metrics
    assert {"chain_k4", "eagle2-b2_k4", "ecospec-b2_k4", "tree_target_forwards_per_token"} <= (
        metrics.keys()
    )
    # With chains allowed beside the trees, the bound can only grow.
    assert metrics["chain-or-eagle2-b2_k4"] >= metrics["chain_k4"] - 1e-9


def test_tree_arguments_are_checked_before_anything_loads(capsys):
    # parse_args is all a job runs before it loads anything: exit 2 there, with the reason.
    from jobs.bench_tree import parse_args as bench_tree_args
    from jobs.extract import parse_args as extract_args

    for parse, argv, why in [
        (bench_tree_args, ["--policies", "fixed:k=2"], "fixed is not a tree policy"),
        (bench_tree_args, ["--rules", "beam"], "the selection must be one of"),
        (bench_tree_args, ["--policies", "tree:gamma=1"], "gamma must be >= 2"),
        (extract_args, ["--trees", "eagle2:q=1"], "unknown knob"),
        (extract_args, ["--trees", "eagle2,eagle2:b=2"], "given twice"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            parse(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and why in err, (argv, err[-500:])
