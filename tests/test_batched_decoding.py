"""Continuous batching (pipeline.decode.batched, serving.batched_worker) decodes every
generation as it would alone: the slot cache keeps sequences apart, greedy output of every
policy in a batch equals plain greedy decoding, a seeded sampled generation in a batch is the
same seed's generation alone (token for token, every policy that decides from its own
generation), and generations join, leave, fail and cancel one by one."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from transformers import DynamicCache

from pipeline.decode.batched import BatchedEngine
from pipeline.decode.batching import MAX_TARGET_WAIT
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.types import Generation, SamplingConfig
from pipeline.models.kvcache import keep_positions
from pipeline.models.loading import load_pair
from pipeline.models.slots import SlotCache
from serving.batched_worker import BatchedDecodeWorker
from serving.worker import DecodeTask
from tests.test_engine import perturbed_pair
from tests.tinymodels import FAMILIES

GREEDY_TOKENS = 20


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny forwards


@pytest.fixture(scope="module")
def embedded():
    """The committed pair and its artifacts: every policy, the cost-aware ones included."""
    return load_pair("models/target", "models/draft", "cpu", "float32", "eager"), load_artifacts()


PROMPTS = [
    "def add(a, b):\n",
    "import numpy as np\n\n\ndef mean(xs):\n    ",
    "The cat",
    "for i in range(10):\n    print(",
    "x",
    "class Stack:\n    def __init__(self):\n",
]


def _plain_greedy(pair, ids: list[list[int]], n: int) -> list[list[int]]:
    engine = SpeculativeEngine(pair)
    return [engine.generate(p, make_policy("ar"), n).tokens for p in ids]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_oss"])
def test_the_slot_cache_keeps_sequences_apart(family):
    """Packed forwards over a slot cache (rows growing, rolled back, a tree path kept) give
    each sequence the logits of its own DynamicCache, for every MoE family's attention."""
    pair = perturbed_pair(family, noise=0.3, seed=2)
    model = pair.target
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in (7, 3, 12)]
    cache = SlotCache(model.config.num_hidden_layers, rows=2, capacity=4)  # both must grow
    rows = [cache.acquire() for _ in seqs]

    def packed(parts):
        positions = [
            p for r, ids in parts for p in range(cache.length[r], cache.length[r] + len(ids))
        ]
        mask = cache.plan([(r, len(ids), None) for r, ids in parts], model.dtype, pair.device)
        ids = torch.tensor([[t for _, ids in parts for t in ids]])
        out = model(
            ids,
            past_key_values=cache,
            use_cache=True,
            attention_mask=mask,
            position_ids=torch.tensor([positions]),
        )
        return out.logits[0]

    def solo(ids):
        c = DynamicCache(config=model.config)
        return model(torch.tensor([ids]), past_key_values=c, use_cache=True).logits[0, -1], c

    with torch.no_grad():
        packed([(r, s[:-1]) for r, s in zip(rows, seqs, strict=True)])
        got = packed([(r, s[-1:]) for r, s in zip(rows, seqs, strict=True)])
        for j, s in enumerate(seqs):
            torch.testing.assert_close(got[j], solo(s)[0], atol=1e-4, rtol=1e-4)
        assert cache.rows >= 3 and cache.capacity >= 12
        # Row 1 rolls back two positions and takes other tokens; rows 0 and 2 are untouched.
        cache.length[rows[1]] -= 2
        alt = seqs[1][:1] + [6]
        got = packed([(rows[1], [6]), (rows[0], [9])])
        torch.testing.assert_close(got[0], solo(alt)[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], solo(seqs[0] + [9])[0], atol=1e-4, rtol=1e-4)
        # Keep a non-contiguous path (a tree's accepted branch): cache positions 0, 2.
        base = cache.length[rows[2]] - 3
        cache.keep(rows[2], base, [0, 2])
        _, ref = solo(seqs[2])
        keep_positions(ref, base, [0, 2])
        want = model(torch.tensor([[4]]), past_key_values=ref, use_cache=True).logits[0, -1]
        torch.testing.assert_close(packed([(rows[2], [4])])[0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_in_a_batch_decodes_plain_greedy(name, embedded):
    """Six prompts, four at a time (generations join as others end): every generation's
    greedy tokens equal plain greedy decoding's, and the batch really packed them."""
    pair, artifacts = embedded
    ids = [pair.tokenizer.encode(p) for p in PROMPTS]
    want = _plain_greedy(pair, ids, GREEDY_TOKENS)
    engine = BatchedEngine(pair)
    got = engine.generate_many(
        ids, lambda: make_policy(name, artifacts), GREEDY_TOKENS, max_batch=4, stop_at_eos=False
    )
    assert [g.tokens for g in got] == want
    records = engine.batcher.records
    assert max(r.rows for r in records) == 4
    for r in records:  # the union over the batch: at least one token's experts, at most all
        assert all(pair.spec.top_k <= u <= pair.spec.num_experts for u in r.union)
    assert engine.batcher.caches["target"].free == sorted(engine.batcher.caches["target"].free)
    assert len(engine.batcher.caches["target"].free) == engine.batcher.caches["target"].rows


def test_a_deep_tree_does_not_hold_a_shallow_generation_to_its_depth(embedded):
    """A tree of 40 levels beside a one-token chain: the chain's verification waits for at most
    MAX_TARGET_WAIT of the tree's draft forwards, not for all 40 (41 in a row without the
    cap), and both texts stay greedy."""
    pair, _ = embedded
    ids = [pair.tokenizer.encode(p) for p in PROMPTS[:2]]
    deep = make_policy("tree", depth=40, branch=2, gamma=8)
    engine = BatchedEngine(pair)
    got = engine.generate_many(
        ids, None, 12, max_batch=2, stop_at_eos=False, policies=[deep, make_policy("fixed", k=1)]
    )
    assert [g.tokens for g in got] == _plain_greedy(pair, ids, 12)
    runs, run = [], 0  # consecutive draft forwards between two target forwards
    for record in engine.batcher.records:
        if record.side == "draft":
            run += 1
        else:
            runs.append(run)
            run = 0
    # Beside the waits: the chain's own draft forward, and the one running when it asked.
    assert max(runs) <= MAX_TARGET_WAIT + 2, runs


def _one_batch(engine: BatchedEngine, jobs: list, n: int, sampling, max_batch: int) -> list:
    """Every (prompt ids, policy, seed) of ``jobs`` decoded in one continuous batch,
    ``max_batch`` at a time, a new one joining as one ends (BatchedEngine.generate_many with a
    policy of each generation's own): the generations in job order."""
    results: list = [None] * len(jobs)
    seats = threading.Semaphore(max_batch)
    threads: list[threading.Thread] = []

    def one(i: int) -> None:
        ids, policy, seed = jobs[i]
        try:
            with engine.batcher.participant():
                results[i] = engine.generate(ids, policy, n, sampling, seed, stop_at_eos=False)
        except BaseException as exc:
            results[i] = exc
        finally:
            seats.release()

    def admit() -> None:
        for i in range(len(jobs)):
            seats.acquire()
            threads.append(threading.Thread(target=one, args=(i,), daemon=True))
            threads[-1].start()

    admitter = threading.Thread(target=admit, daemon=True)
    admitter.start()
    deadline = time.monotonic() + 300  # liveness only
    while admitter.is_alive() or any(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, "the batch did not finish"
        engine.batcher.run_once()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


SEEDED_TOKENS = 16


def test_a_seeded_generation_in_a_batch_draws_what_it_draws_alone(embedded):
    """T = 1: each generation owns its random source (a torch.Generator seeded with its seed),
    and a policy that decides from its own generation alone consumes it in the same order in a
    batch as alone, so the batch cannot change its draws: every registered policy (`batch`
    too, without a batch cost model, where it is its batch-1 rule) gives, seed for seed, the
    tokens it gives decoded alone, exactly, beside neighbours of every other policy on other
    prompts and seeds, joining and leaving. The exception, in the same batch: `batch` with the
    committed batch cost model plans its lengths with its neighbours' acceptance (its
    distribution is exact, tests/test_lossless_sampling.py; its tokens for a seed are not
    asserted). That the seed matters: one policy on one prompt with two seeds differs."""
    pair, artifacts = embedded
    meta = {k: v for k, v in artifacts.cost.meta.items() if k != "batch"}
    alone_batch = dataclasses.replace(
        artifacts, cost=dataclasses.replace(artifacts.cost, meta=meta)
    )
    assert artifacts.cost.batch is not None and alone_batch.cost.batch is None
    sampling = SamplingConfig(temperature=1.0)
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    # (policy, artifacts, prompt): every policy on the prompts in turn; `fixed` once more on
    # its own prompt, with the next seed.
    cases = [(name, artifacts, i % len(prompts)) for i, name in enumerate(sorted(POLICIES))]
    cases = [c if c[0] != "batch" else ("batch", alone_batch, c[2]) for c in cases]
    fixed = next(i for i, c in enumerate(cases) if c[0] == "fixed")
    cases.append(cases[fixed])
    jobs = [
        (prompts[p], make_policy(name, art), 1000 + i) for i, (name, art, p) in enumerate(cases)
    ]
    planner = make_policy("batch", artifacts)  # plans with its neighbours (first in): not compared
    engine = BatchedEngine(pair)
    got = _one_batch(engine, [(prompts[0], planner, 7), *jobs], SEEDED_TOKENS, sampling, 6)[1:]
    assert max(r.rows for r in engine.batcher.records if r.side == "target") == 6
    assert engine.batcher.economy is not None  # `batch` did plan with the batch
    single = SpeculativeEngine(pair)
    for (name, art, _), (ids, _, seed), batched in zip(cases, jobs, got, strict=True):
        lone = single.generate(
            ids, make_policy(name, art), SEEDED_TOKENS, sampling, seed, stop_at_eos=False
        )
        assert batched.tokens == lone.tokens, (name, seed, batched.tokens, lone.tokens)
    assert got[fixed].tokens != got[len(cases) - 1].tokens  # same prompt and policy, other seed


def _task(pair, text: str, policy, max_tokens: int, out: dict, key: str, **kw) -> DecodeTask:
    def deliver(item) -> None:
        if isinstance(item, (Generation, BaseException)):
            out[key] = item

    return DecodeTask(
        pair.tokenizer.encode(text),
        policy,
        max_tokens,
        SamplingConfig(),
        0,
        kw.get("stops", []),
        time.monotonic() + 60,
        deliver,
        key,
    )


class _Boom(Exception):
    pass


def test_the_replica_worker_fails_cancels_and_stops_generations_one_by_one(embedded):
    """In one batch: a generation whose policy raises fails alone; a cancelled one ends
    "cancelled"; one ends at its stop string; the others decode plain greedy; more
    generations than seats (or than the positions a step may verify) take turns; every cache
    slot is given back."""
    pair, _ = embedded

    class Failing:
        name = "boom"

        def reset(self):
            pass

        def propose(self, drafter, committed):
            raise _Boom("proposal failed")

    engine = BatchedEngine(pair)
    # Seats: 3, and 8 positions verified per step: two chains of k = 3 (4 positions each).
    worker = BatchedDecodeWorker(engine, stall_limit_s=30, max_batch=3, max_positions=8)
    out: dict = {}
    texts = PROMPTS[:5]
    tasks = [
        _task(pair, t, make_policy("fixed", k=3), 16, out, f"ok{i}") for i, t in enumerate(texts)
    ]
    tasks.append(_task(pair, PROMPTS[0], Failing(), 16, out, "boom"))
    cancelled = _task(pair, PROMPTS[1], make_policy("fixed", k=3), 400, out, "cancel")
    tasks.append(cancelled)
    want = _plain_greedy(pair, [pair.tokenizer.encode(t) for t in texts], 16)
    stop_text = pair.tokenizer.decode(want[2][4:7])
    tasks.append(
        _task(pair, texts[2], make_policy("fixed", k=3), 16, out, "stop", stops=[stop_text])
    )
    for task in tasks:
        worker.submit(task)
    threading.Timer(0.5, cancelled.cancel.set).start()
    deadline = time.monotonic() + 120
    while len(out) < len(tasks):
        assert time.monotonic() < deadline, sorted(out)
        assert worker.stalled() is None
        time.sleep(0.05)
    assert isinstance(out["boom"], _Boom)
    assert out["cancel"].finish_reason == "cancelled" and len(out["cancel"].tokens) < 400
    assert out["stop"].finish_reason == "stop" and stop_text not in out["stop"].text
    for i in range(len(texts)):
        assert out[f"ok{i}"].tokens == want[i][: len(out[f"ok{i}"].tokens)]
        assert out[f"ok{i}"].finish_reason in ("length", "eos")
    assert worker.counts == {"completed": 6, "cancelled": 1, "deadline": 0, "failed": 1}
    assert worker.shutdown(10)
    for cache in engine.batcher.caches.values():
        assert len(cache.free) == cache.rows
    steps = [r for r in engine.batcher.records if r.side == "target" and not r.prefills]
    assert max(r.rows for r in steps) == 2


def test_sliding_window_models_are_refused_with_a_way_out():
    pair = perturbed_pair("gpt_oss", noise=0.3)
    with pytest.raises(ValueError, match="max_batch=1"):
        BatchedEngine(pair)
