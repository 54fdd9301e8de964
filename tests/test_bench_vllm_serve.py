"""jobs.bench_vllm_serve: vLLM's own client (vllm bench serve) over the project's prompts.

The prompt file is vLLM's ``custom`` dataset, the command lines are `vllm bench serve`'s, the
table comes from vLLM's result JSONs (fixtures saved from a run of its client) and the app's
spec-decode counters. One end-to-end run drives vLLM's real client, in the vLLM environment,
against a stand-in OpenAI server (stdlib http.server: /v1/models, streamed /v1/completions,
/metrics shaped like Ray's export of vLLM's counters) that records what it was sent: the
prompts vLLM's loader read from the file are the ones the project's reader gave.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.bench import vllm_bench_serve as bench
from pipeline.bench.vllm_bench_serve import (
    BenchSettings,
    Cell,
    Run,
    assign_spec,
    client_command,
    parse_spec_counters,
    plan,
    write_prompts,
)
from pipeline.bench.vllm_bench_serve_table import format_table, summarize

FIXTURES = Path(__file__).parent / "fixtures" / "bench_vllm_serve"


def _settings(tmp_path: Path, **kw) -> BenchSettings:
    base = dict(
        base_url="http://127.0.0.1:8000",
        models=("ours", "none"),
        concurrency=(1, 4),
        temperatures=(0.0, 1.0),
        repeats=2,
        max_tokens=32,
        tokenizer="models/target",
        out=tmp_path,
    )
    return BenchSettings(**(base | kw))


def test_the_prompt_file_is_vllms_custom_dataset(tmp_path):
    """One {"prompt": text} object a line (CustomDataset: a 'prompt' column), in order."""
    from pipeline.data.domains import load_prompts

    texts = [p.text for p in load_prompts("humaneval", 3)] + ['a "quote"\nand ✓', "123"]
    path = write_prompts(texts, tmp_path / "p" / "humaneval.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"prompt": t} for t in texts]


def test_runs_interleave_the_model_ids_within_each_repeat(tmp_path):
    cells = plan(_settings(tmp_path), ["sharegpt", "humaneval"])
    assert len(cells) == 2 * 2 * 2 * 2 * 2
    assert [c.model for c in cells[:4]] == ["ours", "none", "ours", "none"]
    assert (cells[0].concurrency, cells[2].concurrency) == (1, 4)
    assert [c.repeat for c in cells[:16]] == [0] * 16 and cells[16].repeat == 1
    # Each repeat starts every cell with the next model id: none first in repeat 1.
    assert [c.model for c in cells[16:20]] == ["none", "ours", "none", "ours"]
    assert cells[0].name == "sharegpt_T0_c1_ours_r0"
    assert Cell("/data/q a.jsonl", 1.0, 8, "none", 2).name == "q_a_T1_c8_none_r2"


def test_the_command_is_vllm_bench_serve(tmp_path):
    settings = _settings(tmp_path, extra_args=("--num-warmups", "2"))
    cell = Cell("sharegpt", 0.0, 4, "ours", 1)
    cmd = client_command(settings, cell, tmp_path / "sharegpt.jsonl", 32)
    assert cmd[1:3] == ["-c", bench.CLIENT] and "from vllm.benchmarks.serve import" in cmd[2]
    args = cmd[3:]
    opts = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert opts["--dataset-name"] == "custom" and opts["--num-prompts"] == "32"
    assert (opts["--model"], opts["--max-concurrency"], opts["--temperature"]) == ("ours", "4", "0")
    assert (opts["--base-url"], opts["--endpoint"]) == (settings.base_url, "/v1/completions")
    assert (opts["--custom-output-len"], opts["--tokenizer"]) == ("32", "models/target")
    assert opts["--result-filename"] == "sharegpt_T0_c4_ours_r1.json"
    assert {"--save-result", "--skip-chat-template", "--disable-shuffle"} <= set(args)
    assert args[args.index("--num-warmups") + 1] == "2"
    # --metadata takes the rest (nargs="*"), so it comes last
    assert args[-3:] == ["--metadata", "source=sharegpt", "repeat=1"]


RAY_METRICS = """\
# HELP ray_vllm_spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE ray_vllm_spec_decode_num_drafts_total counter
ray_vllm_spec_decode_num_drafts_total{ReplicaId="r1",engine="0",model_name="ours"} 10.0
ray_vllm_spec_decode_num_drafts_total{ReplicaId="r2",engine="0",model_name="ours"} 5.0
ray_vllm_spec_decode_num_drafts{ReplicaId="r1",engine="0",model_name="ours"} 10.0
ray_vllm_spec_decode_num_draft_tokens_total{ReplicaId="r1",engine="0",model_name="ours"} 60.0
ray_vllm_spec_decode_num_accepted_tokens_total{ReplicaId="r1",engine="0",model_name="ours"} 30
ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{model_name="ours",position="0"} 9.0
ray_serve_num_http_requests_total{route="/v1/completions"} 7.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="k2"} 4.0
"""


def test_spec_counters_are_read_per_model_id():
    counters = parse_spec_counters(RAY_METRICS)
    assert counters["ours"] == {"drafts": 15.0, "draft_tokens": 60.0, "accepted": 30.0}
    assert counters["k2"]["drafts"] == 4.0 and set(counters) == {"ours", "k2"}


def test_a_runs_counts_last_until_its_model_ids_next_run(tmp_path):
    """Ray exports with a delay: counts that land after a run belong to it, not the next."""
    runs = [Run(c, []) for c in plan(_settings(tmp_path, concurrency=(1,), repeats=2), ["s"])]
    # ours T0 r0, none T0 r0, ours T1 r0, none T1 r0, then repeat 1 none first: none T0 r1,
    # ours T0 r1, none T1 r1, ours T1 r1: 8 runs, 9 reads
    reads = [
        {"ours": {"drafts": 10.0 * i, "draft_tokens": 0.0, "accepted": 5.0 * i}} for i in range(9)
    ]
    reads[5] = None  # a read that failed: the runs it starts and ends have no counts
    assign_spec(runs, reads)
    assert runs[0].spec == {"drafts": 20.0, "draft_tokens": 0.0, "accepted": 10.0}
    assert runs[1].spec == {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    assert runs[2].spec is None and runs[5].spec is None  # ours T1 r0 ends at read 5
    assert runs[3].spec is not None  # none T1 r0: reads 3 to 4
    assert runs[7].spec["drafts"] == 10.0  # the last run of ours: until the final read


def _fixture_runs() -> list[Run]:
    """Saved vLLM results (2 model ids x 3 repeats), their throughputs set to known values;
    ours' repeat 1 failed as a run, none's repeat 2 lost one request."""
    tok_s = {("ours", 0): 120.0, ("ours", 2): 90.0, ("none", 0): 100.0, ("none", 1): 80.0}
    tok_s[("none", 2)] = 60.0
    runs = []
    for r in range(3):
        for model in ("ours", "none"):
            cell = Cell("sharegpt", 0.0, 4, model, r)
            result = json.loads((FIXTURES / f"{cell.name}.json").read_text())
            if (model, r) == ("ours", 1):
                runs.append(Run(cell, [], None, "exit 1 (log x): boom"))
                continue
            result["output_throughput"] = tok_s[(model, r)]
            if (model, r) == ("none", 2):
                result["failed"], result["completed"] = 1, result["completed"] - 1
            spec = (
                {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 15.0 + r}
                if model == "ours"
                else None
            )
            runs.append(Run(cell, [], result, None, spec))
    return runs


def test_the_table_from_saved_results():
    runs = _fixture_runs()
    (cell,) = summarize(runs)
    ours, none = cell["rows"]["ours"], cell["rows"]["none"]
    assert ours["tok_s"] == (105.0, 90.0, 120.0)
    assert none["tok_s"] == (80.0, 60.0, 100.0)
    # paired by repeat: 120/100 and 90/60 (repeat 1 has no ours)
    assert ours["vs_base"] == (pytest.approx(1.35), pytest.approx(1.2), pytest.approx(1.5))
    assert none["vs_base"] == (1.0, 1.0, 1.0)
    saved = [r.result for r in runs if r.result and r.cell.model == "none"]
    assert none["tpot_p50_ms"][0] == pytest.approx(sorted(x["median_tpot_ms"] for x in saved)[1])
    assert none["tpot_p99_ms"] == pytest.approx(sorted(x["p99_tpot_ms"] for x in saved)[1])
    assert none["ttft_p50_ms"] == pytest.approx(sorted(x["median_ttft_ms"] for x in saved)[1])
    requests = sum(x["completed"] + x["failed"] for x in saved)
    assert (none["failed"], none["requests"], none["runs_failed"]) == (1, requests, 0)
    assert ours["runs_failed"] == 1
    assert ours["accepted_len"] == pytest.approx(1 + 16 / 10)  # median of 2.5 and 2.7
    assert none["accepted_len"] is None
    text = format_table([cell], runs)
    assert "sharegpt  T=0  c=4" in text and "x none" in text
    assert "1.350" in text and "1.20-1.50" in text and "2.60" in text
    assert f"1/{requests}" in text and "ours: exit 1 (log x): boom" in text


def test_vllms_own_accepted_length_comes_first():
    runs = _fixture_runs()
    runs[0].result["spec_decode_acceptance_length"] = 3.25
    runs[4].spec = None
    (cell,) = summarize(runs)
    assert cell["rows"]["ours"]["accepted_len"] == 3.25


def test_the_job_checks_its_options(capsys):
    from jobs.bench_vllm_serve import parse_args

    args = parse_args([])
    assert (args.concurrency, args.temperatures, args.repeats) == ([1, 2, 4, 8, 16], [0.0, 1.0], 3)
    assert (args.models, args.baseline, args.base_url) == ((), "none", "http://127.0.0.1:8000")
    assert args.source == ["sharegpt", "humaneval"]
    assert parse_args(["--vllm-args=--num-warmups 2 --ignore-eos"]).vllm_args == [
        "--num-warmups",
        "2",
        "--ignore-eos",
    ]
    for bad, why in (
        (["--models", "ours,ours"], "distinct model ids"),
        (["--limit", "4"], "leaves clients idle"),
        (["--temperatures", "-1"], "must be >= 0"),
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert why in capsys.readouterr().err


class _FakeApp(BaseHTTPRequestHandler):
    """An OpenAI-compatible stand-in: streams max_tokens chunks; `ours` moves spec counters."""

    models = ("ours", "none")
    sent: list[dict] = []
    counters: dict[str, float] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def _reply(self, code: int, body: str, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._reply(200, json.dumps({"data": [{"id": m} for m in self.models]}))
        elif self.path == "/metrics":
            with self.lock:
                c = dict(self.counters)
            names = {
                "drafts": "drafts",
                "draft_tokens": "draft_tokens",
                "accepted": "accepted_tokens",
            }
            text = "".join(
                f'ray_vllm_spec_decode_num_{names[k]}_total{{model_name="ours"}} {v}\n'
                for k, v in c.items()
            )
            self._reply(200, text, "text/plain")
        else:
            self._reply(404, "{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(body["max_tokens"])
        with self.lock:
            self.sent.append(body)
            if body["model"] == "ours":
                for key, value in (("drafts", n / 2), ("draft_tokens", n), ("accepted", n / 2)):
                    self.counters[key] += value
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "text": " a"}]}
        for _ in range(n):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


def test_vllms_client_runs_the_project_prompts(tmp_path, monkeypatch, capsys):
    """The job end to end with vLLM's real client (one run: each costs its import of vLLM):
    the stand-in app receives exactly the prompts the project's reader gave, as the command
    asked; the table has the accepted length from the counters."""
    from pipeline.vllm_spec.env import vllm_python

    try:
        vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (make test builds it)")
    from jobs.bench_vllm_serve import main

    turns = ["def add(a, b):", '  a "quote"\nand ✓ ünï', "123", "Tell me a story."]
    source = tmp_path / "q.jsonl"
    source.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n"
            for i, t in enumerate(turns)
        )
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    _FakeApp.sent.clear()
    out = tmp_path / "out"
    try:
        runs = main(
            ["--base-url", url, "--models", "ours", "--source", str(source)]
            + ["--concurrency", "2", "--temperatures", "0", "--repeats", "1", "--max-tokens", "6"]
            + ["--metrics-url", f"{url}/metrics", "--out", str(out)]
        )
    finally:
        server.shutdown()
    assert [r.error for r in runs] == [None], runs[0].error
    sent = _FakeApp.sent
    assert sorted(b["prompt"] for b in sent) == sorted(turns)
    assert {(b["model"], b["max_tokens"], b["temperature"]) for b in sent} == {("ours", 6, 0.0)}
    assert runs[0].result["completed"] == 4
    assert (out / "results" / "q_T0_c2_ours_r0.json").is_file()
    assert json.loads((out / "runs.jsonl").read_text())["command"] == runs[0].command
    assert runs[0].spec == {"drafts": 12.0, "draft_tokens": 24.0, "accepted": 12.0}
    table = capsys.readouterr().out.split("vLLM's client (vllm bench serve)")[1]
    ours = next(line for line in table.splitlines() if line.strip().startswith("ours"))
    assert ours.split()[-1] == "2.00" and "0/4" in ours
