"""The diagnostic tools (tools/): each runs as ``python -m tools.NAME`` from the repository
root with nothing on PYTHONPATH, and each measures for real on the embedded models or a
scaled-down random layout on the CPU (small settings: a smoke test, not a measurement)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.decode.policies.artifacts import DEFAULT_COSTMODEL
from pipeline.models.loading import REPO_ROOT
from tools import engine_on_device, step_parts, where_pass_time_goes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOLS = ("step_parts", "engine_on_device", "where_pass_time_goes")


# What `python -m NAME` does (runpy, the module run as __main__, the working directory first on
# sys.path), for every tool in one interpreter: torch is imported once, not once per tool.
RUN_AS_MAIN = """
import runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        print(name, "exit", exc.code)
"""


def test_each_tool_runs_as_a_module_from_the_repository_root():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_AS_MAIN, *(f"tools.{name}" for name in TOOLS)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in TOOLS:
        assert f"usage: python -m tools.{name}" in proc.stdout, proc.stdout
        assert f"tools.{name} exit 0" in proc.stdout, proc.stdout


def test_step_parts_reads_policy_specs_with_their_files():
    spec = step_parts.parse_spec("throughput:max_k=8:adapt=0.1@acc.json#cost.json")
    assert (spec.name, spec.knobs) == ("throughput", {"max_k": 8, "adapt": 0.1})
    assert (spec.acceptance, spec.costmodel) == (Path("acc.json"), Path("cost.json"))
    plain = step_parts.parse_spec("fixed:k=3")
    assert (plain.name, plain.knobs, plain.acceptance, plain.costmodel) == (
        "fixed",
        {"k": 3},
        None,
        None,
    )
    with pytest.raises(ValueError, match="unknown knob"):
        step_parts.parse_spec("fixed:depth=3")


def test_step_parts_refuses_bad_arguments_before_loading(capsys):
    for argv in (
        ["--policies", "nope"],
        ["--policies", "fixed", "--domains", "poetry"],
        ["--policies", "fixed", "--passes", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            step_parts.parse_args(argv)
        assert exc.value.code == 2, argv
    assert "--policies" in capsys.readouterr().err


def test_step_parts_measures_each_policy_on_the_embedded_pair(capsys):
    step_parts.main(
        [
            "--device", "cpu",
            "--policies", f"fixed:k=2,throughput#{DEFAULT_COSTMODEL}",
            "--domains", "code",
            "--limit", "1",
            "--max-new-tokens", "8",
            "--passes", "1",
        ]
    )  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == step_parts.HEADER
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows.keys() == {"fixed:k=2", f"throughput#{DEFAULT_COSTMODEL}"}
    fixed = rows["fixed:k=2"]
    assert float(fixed[1]) > 0  # tok/s
    assert float(fixed[9]) == pytest.approx(2.0)  # draft forwards per step: k
    assert all(float(x) > 0 for x in fixed[12:16])  # modelled times and measured / modelled


def test_engine_on_device_checks_each_policy_on_both_pairs(capsys):
    code = engine_on_device.main(
        ["--device", "cpu", "--policies", "fixed,throughput", "--max-new-tokens", "5"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("greedy==ar True") == 4, out  # 2 policies x 2 pairs
    assert "== draft (1 layer) on cpu" in out and "== eagle3 head on cpu" in out
    assert "T=1 tokens [5, 5, 5]" in out
    assert out.rstrip().endswith("failures: 0")


def test_engine_on_device_covers_every_single_session_policy():
    args = engine_on_device.parse_args(["--device", "cpu"])
    assert args.policies == engine_on_device.single_session_policies()
    assert "batch" not in args.policies and {"ar", "throughput", "specdec"} <= set(args.policies)
    with pytest.raises(SystemExit):
        engine_on_device.parse_args(["--policies", "batch"])


def test_where_pass_time_goes_times_and_profiles_passes_on_the_cpu(capsys):
    where_pass_time_goes.main(
        [
            "--device", "cpu",
            "--layers", "1",
            "--context", "16",
            "--ms", "1,3",
            "--impls", "eager",
            "--warmup", "0",
            "--repeats", "1",
        ]
    )  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[:5] for line in lines] == [
        ["eager", "layers", "1", "m", "1:"],
        ["eager", "layers", "1", "m", "3:"],
    ]
    for line in lines:
        wall = float(line.split("wall")[1].split()[0])
        assert wall > 0
        assert "GPU kernels    nan ms" in line  # no GPU: no kernel time
