"""The layout holds: every module imports, no import cycle between the project's files (lazy
imports inside functions and imports only for type checking count: a cycle through type hints
is still two files that cannot be read apart), and no module grows past a generous ceiling.
Size is a guideline (docs/architecture.md, "Module size"): split a module when it holds two
ideas, not to pass a count; one past the guideline says why in LONG_MODULES."""

from __future__ import annotations

import ast
import importlib
import subprocess

import pytest

from pipeline.models.loading import REPO_ROOT

PACKAGES = ("pipeline", "serving", "jobs", "vllm_serving", "tools")
# Modules that import vLLM (or ray.serve.llm, which needs it): they run in the vLLM
# environment (.venv-vllm) and are imported there.
VLLM_ENV = (
    "pipeline.vllm_spec.scheduler",
    "pipeline.vllm_spec.catch_up_draft",
    "pipeline.vllm_spec.free_when_off",
    "vllm_serving.ingress",
    "vllm_serving.app",
)
# Bench modules run only as the vLLM environment's subprocess (python -m
# pipeline.bench.vllm_run_cells, started by pipeline.bench.vllm): vLLM imported inside their
# functions, so they import here too, but no module of this environment imports them.
VLLM_SUBPROCESS = ("pipeline.bench.vllm_run_cells", "pipeline.bench.vllm_cells")
# The guideline: past GUIDELINE_LINES a module is named in LONG_MODULES with the one idea
# that needs the length (path: reason). No module, named or not, passes MAX_LINES.
GUIDELINE_LINES = 300
MAX_LINES = 450
LONG_MODULES: dict[str, str] = {}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules a module imports, at any depth (functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(tree, known) - {name} for name, tree in modules.items()}
    assert _cycles(graph) == [], "files that import each other (move what both need below them)"


def test_the_library_never_imports_its_users():
    """pipeline is the library: serving and jobs sit on it, never under it; serving is thin
    over pipeline and no job. The harnesses (pipeline.bench) sit on top of the library: they
    may drive the research endpoint (serving), and only they and the jobs import them."""
    modules = _modules()
    known = set(modules)
    for name, tree in modules.items():
        imported = _imports(tree, known)
        used = {m.split(".")[0] for m in imported}
        bench = name == "pipeline.bench" or name.startswith("pipeline.bench.")
        if bench:
            assert used <= {"pipeline", "serving"}, (name, used)
        elif name.startswith("pipeline"):
            assert used <= {"pipeline"}, (name, used)
            assert not {m for m in imported if m.startswith("pipeline.bench")}, name
        if name.startswith("serving") or name.startswith("vllm_serving"):
            assert "jobs" not in used, name
            assert not {m for m in imported if m.startswith("pipeline.bench")}, name


def test_the_vllm_subprocess_modules_stay_apart():
    """What the vLLM environment runs as a subprocess imports nothing but itself and the vLLM
    side of the library (pipeline.vllm_spec), and no other module imports it."""
    modules = _modules()
    known = set(modules)
    for name, tree in modules.items():
        imported = _imports(tree, known)
        if name in VLLM_SUBPROCESS:
            outside = {m for m in imported if m not in VLLM_SUBPROCESS}
            assert all(m.startswith("pipeline.vllm_spec.") for m in outside), (name, outside)
        else:
            assert not imported & set(VLLM_SUBPROCESS), name


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_an_import_for_type_hints_counts():
    """The cycles this test exists for ran through TYPE_CHECKING blocks (a scorer importing
    its caller's row type), so such an import is an edge like any other."""
    known = {"p.a", "p.b"}
    a = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import Row\n")
    b = ast.parse("def f():\n    import p.a\n")
    graph = {"p.a": _imports(a, known), "p.b": _imports(b, known)}
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a"}}
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_module_size_stays_within_the_guideline():
    """Past GUIDELINE_LINES a module needs a named reason; past MAX_LINES it needs splitting."""
    unexplained, over = {}, {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            name = str(path.relative_to(REPO_ROOT))
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                over[name] = lines
            elif lines > GUIDELINE_LINES and not LONG_MODULES.get(name, "").strip():
                unexplained[name] = lines
    assert over == {}, f"split these modules (past {MAX_LINES} lines): {over}"
    assert unexplained == {}, (
        f"past {GUIDELINE_LINES} lines: say in LONG_MODULES which one idea needs the length, "
        f"or split where the module holds two: {unexplained}"
    )
    missing = [name for name in LONG_MODULES if not (REPO_ROOT / name).is_file()]
    assert missing == [], f"LONG_MODULES names modules that are gone: {missing}"


@pytest.mark.parametrize("name", sorted(set(_modules()) - set(VLLM_ENV)))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_every_vllm_module_imports_in_the_vllm_environment():
    from pipeline.vllm_spec.env import engine_env, vllm_python

    try:
        python = vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (make test builds it)")
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)"
    done = subprocess.run(
        [str(python), "-c", code, *VLLM_ENV, *VLLM_SUBPROCESS],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


JOBS = sorted(
    p.stem for p in (REPO_ROOT / "jobs").glob("*.py") if p.stem not in ("__init__", "cli")
)


@pytest.mark.parametrize("job", JOBS)
def test_every_job_explains_itself(job, capsys):
    """`python -m jobs.X --help` works for every job and names how to run it."""
    module = importlib.import_module(f"jobs.{job}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m jobs.{job}"), out[:200]
