"""Training the learned expert predictor from routing traces (EcoSpec section 4.1, appendix B).

Samples come from an extraction: for every reference token x_t (the ``tokens`` table: token id
and the experts the target's router selected) the input is the token id and the draft's
last-layer hidden state after x_{t-1}, recomputed with one teacher-forced draft pass per
sequence (the same state the online drafter holds when it proposes x_t; for an EAGLE-3 head,
its state reading the target's features, pipeline.models.draft_pass). The split is by
sequence, so held-out accuracy measures unseen text. The loss is the layer-wise cross-entropy
against the uniform distribution over the router's top-k (the paper's eq. 5-6).
train_predictor() runs the whole flow, from an extraction to a saved, evaluated predictor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch

from pipeline.data.schemas import experts_to_numpy
from pipeline.data.shards import read_table
from pipeline.models.adapters import MoESpec
from pipeline.models.draft_pass import draft_pass
from pipeline.models.eagle3 import HeadCache
from pipeline.models.kvcache import crop_to
from pipeline.models.loading import ModelPair
from pipeline.models.timing import timed
from pipeline.predictor.model import (
    ExpertMLP,
    LearnedExpertPredictor,
    TokenExpertPredictor,
    overlap,
)


@dataclass
class RoutingSamples:
    seq_ids: np.ndarray  # [n] sequence of each sample (for the split)
    tokens: np.ndarray  # [n]
    contexts: np.ndarray  # [n, draft hidden] float32
    experts: np.ndarray  # [n, layers, top_k]

    def __len__(self) -> int:
        return len(self.tokens)

    def take(self, mask: np.ndarray) -> RoutingSamples:
        return RoutingSamples(
            self.seq_ids[mask], self.tokens[mask], self.contexts[mask], self.experts[mask]
        )


@torch.no_grad()
def load_samples(extract_dir: Path, pair: ModelPair, spec: MoESpec) -> RoutingSamples:
    """One sample per reference token of the extraction, with its draft context state."""
    sequences = read_table(extract_dir, "sequences")
    tokens = read_table(extract_dir, "tokens")
    seq_ids, toks, ctxs, experts = [], [], [], []
    for row in sequences.to_pylist():
        rows = tokens.filter(pc.equal(tokens.column("seq_id"), row["seq_id"])).sort_by("t")
        if rows.num_rows == 0:
            continue
        prompt = list(row["prompt_ids"])
        ref = rows.column("token_id").to_numpy()  # x_0 (the prompt's last) .. x_N
        ids = torch.tensor([prompt + ref[1:].tolist()], device=pair.device)
        hidden = draft_pass(pair, ids)[1][0].float().cpu()  # a draft model's or a head's
        p0 = len(prompt) - 1
        # x_t sits at absolute position p0 + t; its context is the state one position earlier.
        before = torch.cat([torch.zeros(1, hidden.shape[1]), hidden])  # before[j] = h_{j-1}
        ctx = before[p0 : p0 + len(ref)]
        seq_ids.append(np.full(len(ref), row["seq_id"], dtype=object))
        toks.append(ref)
        ctxs.append(ctx.numpy())
        experts.append(experts_to_numpy(rows.column("experts"), spec.num_moe_layers, spec.top_k))
    if not toks:
        raise ValueError(f"the extraction in {extract_dir} has no reference tokens")
    return RoutingSamples(
        np.concatenate(seq_ids),
        np.concatenate(toks),
        np.concatenate(ctxs),
        np.concatenate(experts).astype(np.int64),
    )


def split_by_sequence(
    samples: RoutingSamples, held_out: float, seed: int
) -> tuple[RoutingSamples, RoutingSamples]:
    """(train, test): a ``held_out`` share of the sequences (at least one) is kept for test."""
    names = np.array(sorted(set(samples.seq_ids.tolist())), dtype=object)
    if len(names) < 2:
        raise ValueError("need at least two sequences to hold some out")
    rng = np.random.default_rng(seed)
    n_test = min(len(names) - 1, max(1, round(held_out * len(names))))
    test_names = set(rng.permutation(names)[:n_test].tolist())
    is_test = np.array([s in test_names for s in samples.seq_ids])
    return samples.take(~is_test), samples.take(is_test)


def layerwise_cross_entropy(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Eq. 6: -sum_l sum_e q log p with q uniform over the router's top-k, averaged over
    tokens. ``logits`` [n, layers, E], ``experts`` [n, layers, top_k]."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.gather(-1, experts).mean(-1)).sum(-1).mean()


@dataclass
class TrainResult:
    predictor: LearnedExpertPredictor
    losses: list[float]  # mean training loss per epoch
    test_loss: float


def train(
    train_set: RoutingSamples,
    test_set: RoutingSamples,
    vocab_size: int,
    spec: MoESpec,
    epochs: int = 30,
    batch_size: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    progress: Callable[[int, float, float], None] | None = None,
) -> TrainResult:
    torch.manual_seed(seed)
    model = ExpertMLP(
        vocab_size, train_set.contexts.shape[1], spec.num_moe_layers, spec.num_experts
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    tok = torch.from_numpy(train_set.tokens)
    ctx = torch.from_numpy(train_set.contexts)
    exp = torch.from_numpy(train_set.experts)
    losses = []
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(tok))
        total = 0.0
        for start in range(0, len(tok), batch_size):
            idx = order[start : start + batch_size]
            loss = layerwise_cross_entropy(model(tok[idx], ctx[idx]), exp[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        sched.step()
        losses.append(total / len(tok))
        test_loss = evaluate_loss(model, test_set)
        if progress:
            progress(epoch, losses[-1], test_loss)
    predictor = LearnedExpertPredictor(model, spec.top_k)
    return TrainResult(predictor, losses, evaluate_loss(model, test_set))


@torch.no_grad()
def evaluate_loss(model: ExpertMLP, data: RoutingSamples) -> float:
    model.eval()
    logits = model(torch.from_numpy(data.tokens), torch.from_numpy(data.contexts))
    return float(layerwise_cross_entropy(logits, torch.from_numpy(data.experts)))


def learned_accuracy(predictor: LearnedExpertPredictor, data: RoutingSamples) -> float:
    pred = predictor.predict_many(data.tokens.tolist(), list(torch.from_numpy(data.contexts)))
    return overlap(pred, data.experts)


def table_accuracy(train_set: RoutingSamples, test_set: RoutingSamples, spec: MoESpec) -> float:
    """The lookup-table baseline fitted on the same training split."""
    table = TokenExpertPredictor.fit(
        zip(train_set.tokens.tolist(), train_set.experts, strict=True), spec.num_experts, spec.top_k
    )
    return table.overlap_accuracy(zip(test_set.tokens.tolist(), test_set.experts, strict=True))


@torch.no_grad()
def predictor_cost(
    predictor: LearnedExpertPredictor, pair: ModelPair, repeats: int = 200, batch: int = 1
) -> dict[str, float]:
    """Median ms of one predictor call on ``batch`` tokens vs one cached single-token draft
    forward, interleaved in one loop so both see the same machine state."""
    predictor.to(pair.device)
    prompt = torch.arange(1, 65, device=pair.device).view(1, -1) % pair.draft.config.vocab_size
    step = torch.tensor([[7]], device=pair.device)
    if pair.draft_is_head:
        head = pair.draft
        cache = HeadCache()
        width = 3 * head.cfg.target_hidden_size
        positions = torch.arange(64, device=pair.device).view(1, -1)
        feats = torch.randn(1, 64, width, device=pair.device, dtype=head.dtype)
        _, out = head(prompt, feats, positions, cache)
        ctx, own = out[0, -1], out[:, -1:]
        at = torch.tensor([[64]], device=pair.device)

        def draft_step():
            head(step, own, at, cache)
            cache.crop(64)

    else:
        from transformers import DynamicCache

        cache = DynamicCache(config=pair.draft.config)
        out = pair.draft(prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
        ctx = out.hidden_states[-1][0, -1]

        def draft_step():
            pair.draft(step, past_key_values=cache, use_cache=True, output_hidden_states=True)
            crop_to(cache, 64)

    tokens, contexts = [7] * batch, [ctx] * batch
    t_pred, t_draft = [], []
    for _ in range(repeats):
        _, ms = timed(pair.device, lambda: predictor.predict_many(tokens, contexts))
        t_pred.append(ms)
        _, ms = timed(pair.device, draft_step)
        t_draft.append(ms)
    pred_ms, draft_ms = float(np.median(t_pred)), float(np.median(t_draft))
    return {"predictor_ms": pred_ms, "draft_step_ms": draft_ms, "ratio": pred_ms / draft_ms}


@dataclass
class TrainedPredictor:
    predictor: LearnedExpertPredictor
    report: dict[str, float | int | str]  # also saved as train_report.json and in the meta


def train_predictor(
    pair: ModelPair,
    extract_dir: Path,
    out: Path,
    epochs: int = 30,
    batch_size: int = 256,
    lr: float = 3e-3,
    held_out: float = 0.2,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> TrainedPredictor:
    """Samples from the extraction in ``extract_dir``, split by sequence, trained, evaluated
    (held-out overlap next to the lookup table; cost per call at 1 and 8 tokens against a draft
    step) and saved under ``out`` with train_report.json."""
    spec = pair.spec
    samples = load_samples(extract_dir, pair, spec)
    train_set, test_set = split_by_sequence(samples, held_out, seed)
    n_test_seqs = len(set(test_set.seq_ids.tolist()))
    log(
        f"{len(train_set):,} training and {len(test_set):,} held-out tokens "
        f"({n_test_seqs} held-out sequences); {spec.num_moe_layers} MoE layers x "
        f"{spec.num_experts} experts, top-{spec.top_k}"
    )

    def progress(epoch: int, loss: float, test_loss: float) -> None:
        if epoch == 0 or (epoch + 1) % 5 == 0 or epoch + 1 == epochs:
            log(
                f"[train_predictor] epoch {epoch + 1}/{epochs}: loss {loss:.3f}, "
                f"held-out {test_loss:.3f}"
            )

    result = train(
        train_set,
        test_set,
        pair.draft.config.vocab_size,
        spec,
        epochs,
        batch_size,
        lr,
        seed,
        progress,
    )
    predictor = result.predictor
    acc = learned_accuracy(predictor, test_set)
    acc_train = learned_accuracy(predictor, train_set)
    acc_table = table_accuracy(train_set, test_set, spec)
    # Timed after the accuracies: predictor_cost moves the predictor onto the pair's device.
    # A tree policy asks for several nodes per call; 8 shows how the call scales with width.
    cost1 = predictor_cost(predictor, pair, batch=1)
    cost8 = predictor_cost(predictor, pair, batch=8)
    report: dict[str, float | int | str] = {
        "held_out_topk_overlap": acc,
        "train_topk_overlap": acc_train,
        "lookup_table_topk_overlap": acc_table,
        "held_out_loss": result.test_loss,
        "train_tokens": len(train_set),
        "held_out_tokens": len(test_set),
        "predictor_ms": cost1["predictor_ms"],
        "predictor_ms_8_nodes": cost8["predictor_ms"],
        "draft_step_ms": cost1["draft_step_ms"],
        "cost_ratio": cost1["ratio"],
        "extract": str(extract_dir),
        "device": str(pair.device),
    }
    predictor.meta = {"report": report}
    predictor.save(out)
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return TrainedPredictor(predictor, report)
