"""The step-cost calibration's instrument inside vLLM (``method: custom_class``): the pair's
draft drafts a random length k ~ U{0..K} per row and step, a designed spread of verified
positions at every batch size, and every engine step is recorded (its time, positions and
attended tokens, the draft's own forwards and, from the target's MoE gates, the experts the
step's pass routed). pipeline.vllm_spec.step_fit fits vLLM's step cost to these records
(jobs.calibrate_vllm); the cost-aware scheduler starts from that fit. The lengths are a
design, not a speculation method: nothing serves with this drafter.

    LLM(model="models/target", dtype="float32", enforce_eager=True, speculative_config={
        "method": "custom_class", "num_speculative_tokens": 4,
        "model": "pipeline.vllm_spec.calibration_drafter.CalibrationDrafter"})

vLLM 0.32 builds it as ``CalibrationDrafter(vllm_config)``, calls ``load_model(target)`` once
and ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` after every engine step
(pipeline.vllm_spec.contract). Its settings travel in ``SPECBOUND_CALIBRATION`` (a JSON object
of CalibrationConfig's fields), read in vLLM's worker process; ``check_draft`` refuses a bad
draft in the process that asked for the engine, before vLLM spawns anything.
"""

from __future__ import annotations

import atexit
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.vllm_spec.draft import PackedDraft
from pipeline.vllm_spec.env_settings import fields_from_env
from pipeline.vllm_spec.router_hook import RouterUnion
from pipeline.vllm_spec.rows import DraftState, StateTable

ENV = "SPECBOUND_CALIBRATION"
CLASS_PATH = "pipeline.vllm_spec.calibration_drafter.CalibrationDrafter"
ROOT = Path(__file__).resolve().parents[2]
FLUSH_EVERY = 20  # step records written to the record file in batches


@dataclass(frozen=True)
class CalibrationConfig:
    draft: str = "models/draft"  # the pair's draft checkpoint (relative paths: the repository's)
    record: str | None = None  # JSONL of step records
    seed: int = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> CalibrationConfig:
        return cls(**fields_from_env(cls, ENV, environ))

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    def path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else ROOT / p


def check_draft(config: CalibrationConfig, target: str | Path) -> Path:
    """The draft checkpoint, checked to exist and to share the target's vocabulary (a
    FileNotFoundError or ValueError says which)."""
    draft = config.path(config.draft)
    if not (draft / "config.json").is_file():
        raise FileNotFoundError(f'no draft checkpoint at {draft} ("draft" in ${ENV})')
    vocab = [_read_config(p).get("vocab_size") for p in (Path(target), draft)]
    if vocab[0] != vocab[1]:
        raise ValueError(
            f"the draft {draft} has vocabulary {vocab[1]}, the target {target} {vocab[0]}: "
            "a draft must share its target's tokenizer"
        )
    return draft


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no checkpoint at {path} (no config.json)") from exc


class CalibrationDrafter:
    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        model_config = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(model_config.max_model_len)
        self.config = CalibrationConfig.from_env()
        self.target_path = model_config.model
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.draft = PackedDraft(
            check_draft(self.config, model_config.model),
            device,
            rows=max(4, vllm_config.scheduler_config.max_num_seqs),
        )
        self.states = StateTable(self.draft.acquire, self.draft.release)
        self.rng = random.Random(self.config.seed)
        self.router: RouterUnion | None = None
        self._last_end: float | None = None
        self._pending: dict[str, Any] | None = None  # what the next step's pass verifies
        self._records: list[dict[str, Any]] = []

    # -- vLLM's contract ---------------------------------------------------------------------
    def load_model(self, target: torch.nn.Module | None = None, *args, **kwargs) -> None:
        """vLLM hands over its target model: its MoE gates are hooked to see the experts
        every step's pass routes to."""
        if self.config.record and target is not None:
            self.router = RouterUnion.attach(target, self.target_path)
            atexit.register(self.flush)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        start = time.perf_counter()
        self._record_step(start)
        self.draft.forward_s = 0.0
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = [
            i
            for i, ids in enumerate(sampled_token_ids)
            if ids and int(num_tokens_no_spec[i]) + 1 < self.max_model_len
        ]
        if rows:
            texts = [
                np.asarray(token_ids_cpu[i, : int(num_tokens_no_spec[i])], dtype=np.int64)
                for i in rows
            ]
            matched = self.states.match(texts)
            caps = [min(self.k, self.max_model_len - len(t) - 1) for t in texts]
            lengths = [self.rng.randint(0, cap) for cap in caps]
            for i, chain in zip(rows, self._draft(matched, texts, lengths), strict=True):
                out[i] = chain
        end = time.perf_counter()
        self._pending = {
            "rows": len(rows),
            "positions": len(rows) + sum(len(c) for c in out),
            "attended": sum((1 + len(out[i])) * int(num_tokens_no_spec[i]) for i in rows),
            "propose_ms": (end - start) * 1e3,
            "draft_ms": self.draft.forward_s * 1e3,
            "draft_forwards": self.draft.records,
        }
        self.draft.records = []
        self._last_end = end
        return out

    # -- one step ----------------------------------------------------------------------------
    def _draft(self, matched, texts, lengths: list[int]) -> list[list[int]]:
        """Each row's chain of its drawn length, the draft's argmax at each position: one
        packed forward catches the drafting rows up, then one packed forward per depth."""
        chains: list[list[int]] = [[] for _ in texts]
        active = [r for r, k in enumerate(lengths) if k > 0]
        if not active:
            return chains
        parts = [self._catch_up(*matched[r], texts[r]) for r in active]
        logits, _ = self.draft.forward(parts)
        for r, top in zip(active, logits.argmax(-1).tolist(), strict=True):
            chains[r].append(top)
        for depth in range(2, max(lengths) + 1):
            going = [r for r in active if lengths[r] >= depth]
            logits, _ = self.draft.forward([(matched[r][0].slot, [chains[r][-1]]) for r in going])
            for r, top in zip(going, logits.argmax(-1).tolist(), strict=True):
                chains[r].append(top)
        for r in active:
            # The draft's cache now holds the text and the chain but its last token.
            matched[r][0].cached = np.concatenate(
                [texts[r], np.asarray(chains[r][:-1], dtype=np.int64)]
            )
        return chains

    def _catch_up(self, state: DraftState, keep: int, text: np.ndarray) -> tuple[int, list[int]]:
        """Cut the state's cache to what its text still shares, and the tokens to feed after
        it (at least the last one: its distribution is the next token's)."""
        keep = min(keep, len(text) - 1)
        self.draft.cut(state.slot, keep)
        return state.slot, text[keep:].tolist()

    # -- the records -------------------------------------------------------------------------
    def _record_step(self, now: float) -> None:
        """The step that just ran verified the previous call's proposals: its time, and the
        positions and experts its pass routed."""
        if self._last_end is None or not self.config.record or self._pending is None:
            return
        record = dict(self._pending, step_ms=(now - self._last_end) * 1e3)
        if self.router is not None:
            positions, union = self.router.take()
            record.update(hook_positions=positions, union=union)
        self._records.append(record)
        if len(self._records) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._records or not self.config.record:
            return
        with open(self.config.path(self.config.record), "a") as f:
            for rec in self._records:
                f.write(json.dumps(rec) + "\n")
        self._records = []
