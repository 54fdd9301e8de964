"""vLLM speculation methods by name, one code path from a name and its knobs to vLLM's
engine settings (speculative_config, scheduler_cls, env), shared by the vLLM app
(vllm_serving.llm_configs) and the benchmark (jobs.bench_vllm --methods: 'name:knob=value:...'
items parsed, checked and expanded, k=A..B: one method per K, before any engine starts).

Names: ``ours`` is the cost-aware scheduler (pipeline.vllm_spec.scheduler) over vLLM's
``draft_model`` drafter with probabilistic drafting, ``ours-eagle3`` the same scheduler over
vLLM's EAGLE-3 drafter; ``draft_model``, ``eagle3``, ``ngram``, ``suffix`` are vLLM's own at
a fixed K, ``none`` no speculation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SCHEDULER_CLASS = "pipeline.vllm_spec.scheduler.CostAwareScheduler"
# The committed EAGLE-3 head of the embedded target (jobs.train_tiny --head-for).
DEFAULT_HEAD = str(Path(__file__).resolve().parents[2] / "models" / "eagle3-head")
# Knobs each method takes; any other knob of `ours` and `ours-eagle3` is a scheduler setting
# (SPECBOUND_SCHEDULER: PlannerConfig's fields, e.g. design=off, decay=0.8).
METHOD_KNOBS: dict[str, set[str]] = {
    "none": set(),
    "ours": {"k", "draft_sample_method"},
    "ours-eagle3": {"k", "head"},
    "draft_model": {"k", "schedule", "draft_sample_method"},
    "eagle3": {"k", "head"},
    "ngram": {"k", "min", "max"},
    "suffix": {"k"},
}
DRAFTERS = {"ours": "draft_model", "ours-eagle3": "eagle3"}  # vLLM's drafter under ours
# How vLLM's draft_model drafts at T > 0: the argmax, or a sample whose probabilities enter
# the rejection test.
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# k=1..6 expands to one method per K. ngram leaves prompt_lookup_min/max unset: vLLM then
# uses 5..5. The schedule is (first batch size: K) ranges, each to the next one's start.
DEFAULT_METHODS = (
    "none,ours:k=4,draft_model:k=1..4,draft_model:k=1..4:draft_sample_method=probabilistic,"
    "draft_model:k=4:schedule=1:4/4:3/8:2/16:1"
)


@dataclass
class Method:
    label: str
    name: str
    knobs: dict = field(default_factory=dict)

    def entry(self, draft: str, head: str = DEFAULT_HEAD, policy: dict | None = None) -> dict:
        """The vllm_run_cells method entry: speculative_config, engine kwargs and env.
        ``policy``: the scheduler's settings for ours and ours-eagle3 (PlannerConfig
        fields; the method's own scheduler knobs add to them)."""
        k, knobs = self.knobs.get("k"), self.knobs
        if self.name == "none":
            return {"name": self.label, "speculative_config": None}
        name = DRAFTERS.get(self.name, self.name)
        config: dict = {"method": name}
        if k is not None:
            config["num_speculative_tokens"] = int(k)
        entry: dict = {"name": self.label, "speculative_config": config}
        if name == "draft_model":
            config["model"] = draft
            # ours drafts by sampling at T > 0 (the draft's probabilities enter the rejection
            # test: sum min(p, q) accepted, not p(argmax q)); at T = 0 it is the argmax.
            default = "probabilistic" if self.name == "ours" else None
            if knobs.get("draft_sample_method", default):
                config["draft_sample_method"] = knobs.get("draft_sample_method", default)
            if "schedule" in knobs:
                config["num_speculative_tokens_per_batch_size"] = parse_schedule(knobs["schedule"])
        elif name == "eagle3":
            config["model"] = str(knobs.get("head", head))
        elif self.name == "ngram":
            config.update(
                {f"prompt_lookup_{b}": int(knobs[b]) for b in ("min", "max") if b in knobs}
            )
        if self.name in DRAFTERS:
            entry["engine_kwargs"] = {"scheduler_cls": SCHEDULER_CLASS}
            own = {key: v for key, v in knobs.items() if key not in METHOD_KNOBS[self.name]}
            entry["env"] = {"SPECBOUND_SCHEDULER": json.dumps(dict(policy or {}) | own)}
        return entry


def parse_schedule(text: str) -> list[list[int]]:
    """'1:4/4:3/8:2' -> [[1, 3, 4], [4, 7, 3], [8, 1_000_000, 2]]: vLLM's inclusive
    (range_start, range_end, K) ranges, the first from batch size 1."""
    try:
        pairs = [tuple(int(x) for x in part.split(":")) for part in text.split("/")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or p[0] < 1 or p[1] < 0 for p in pairs):
        raise ValueError(f"schedule {text!r}: expected start:K/start:K/..., e.g. 1:4/4:3/8:2")
    starts = [p[0] for p in pairs]
    if starts[0] != 1 or starts != sorted(set(starts)):
        raise ValueError(f"schedule {text!r}: batch-size starts must rise from 1")
    ends = [s - 1 for s in starts[1:]] + [1_000_000]
    return [[s, e, k] for (s, k), e in zip(pairs, ends, strict=True)]


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_methods(text: str) -> list[Method]:
    """'none,draft_model:k=1..3,ours:k=4:design=fixed' -> Methods; k=A..B expands."""
    out: list[Method] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, rest = item.partition(":")
        if name not in METHOD_KNOBS:
            raise ValueError(f"unknown method {name!r}; choose among {', '.join(METHOD_KNOBS)}")
        knobs: dict = {}
        last = None
        for pair in rest.split(":") if rest else []:
            key, sep, value = pair.partition("=")
            if not sep and last == "schedule":  # a schedule's own ':' (start:K) rejoined
                knobs["schedule"] += ":" + pair
                continue
            if not sep or not key:
                raise ValueError(f"method {item!r}: knobs are name=value, got {pair!r}")
            if key in knobs:
                raise ValueError(f"method {item!r}: knob {key!r} given twice")
            knobs[key], last = value, key
        out += _expand(name, knobs, item)
    if not out:
        raise ValueError("no methods given")
    labels = [m.label for m in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a method is given twice: {labels}")
    return out


def _expand(name: str, knobs: dict, item: str) -> list[Method]:
    if name in DRAFTERS:  # the scheduler's own settings, checked as it will check them
        from pipeline.vllm_spec.planner_config import PlannerConfig

        own = {key: _value(v) for key, v in knobs.items() if key not in METHOD_KNOBS[name]}
        try:
            PlannerConfig(**own)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"method {item!r}: {exc}") from None
    else:
        bad = set(knobs) - METHOD_KNOBS[name]
        if bad:
            raise ValueError(
                f"method {item!r}: unknown knobs {sorted(bad)} (takes "
                f"{', '.join(sorted(METHOD_KNOBS[name])) or 'none'})"
            )
    k = knobs.get("k")
    if name in ("draft_model", "eagle3", "ours", "ours-eagle3", "ngram") and k is None:
        raise ValueError(f"method {item!r} needs k=<draft tokens> (or k=A..B)")
    ks = [None]
    if k is not None:
        lo, sep, hi = k.partition("..")
        try:
            ks = list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"method {item!r}: k must be an int or A..B, got {k!r}") from None
        if not ks or min(ks) < 1:
            raise ValueError(f"method {item!r}: k must be >= 1, got {k!r}")
    if "schedule" in knobs:
        parse_schedule(knobs["schedule"])
    if knobs.get("draft_sample_method", "greedy") not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"method {item!r}: draft_sample_method is greedy or probabilistic")
    out = []
    for kk in ks:
        values = {key: _value(v) for key, v in knobs.items() if key not in ("k", "schedule")}
        if "schedule" in knobs:
            values["schedule"] = knobs["schedule"]
        if kk is not None:
            values = {"k": kk, **values}
        label = name + "".join(f":{key}={v}" for key, v in values.items())
        out.append(Method(label, name, values))
    return out
