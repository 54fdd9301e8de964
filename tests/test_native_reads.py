"""The compiled reads (pipeline.acceptance.native_reads) give the numbers the tensor calls give:
the same statistics, top token and hidden-state products on random distributions at several
temperatures, and the same `throughput` decisions step by step on the embedded pair; where
they cannot serve (no compiler, SPECBOUND_NATIVE=0, tensors that do not suit, masked logits)
they say so and the tensor calls read."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from pipeline.acceptance import native_reads as nr
from pipeline.acceptance.features import NgramIndex, position_view, position_view_of_reads
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies import throughput
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def native():
    reads = nr.native_reads()
    # Where a C compiler exists (as on CI) the compiled reads must build.
    assert (reads is not None) == (shutil.which("cc") is not None)
    if reads is None:
        pytest.skip("no C compiler on this machine: the tensor calls read")
    return reads


def _position(vocab: int, hidden: int, temperature: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * 3.0
    probs = torch.softmax(logits / temperature, -1)
    return probs, logits, torch.randn(hidden, generator=gen), torch.randn(hidden, 2, generator=gen)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_compiled_reads_equal_the_tensor_calls(native, temperature):
    index = NgramIndex()
    index.extend([5, 9, 5, 9, 5])
    for seed in range(20):
        probs, logits, hidden, weights = _position(4096, 128, temperature, seed)
        reads = native.read(probs, logits, hidden, weights)
        assert reads is not None
        stats, top = position_view_of_reads(reads, index, [9, 5], temperature)
        expected, expected_top = position_view(probs, index, [9, 5], logits, temperature)
        assert top == expected_top == int(probs.argmax())
        # (The compiled dot product sums in double, the tensor one in float32.)
        assert stats == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert reads[4] == pytest.approx((hidden @ weights).tolist(), rel=1e-4, abs=1e-4)


def test_tensors_that_do_not_suit_are_left_to_the_tensor_calls(native):
    probs, logits, hidden, weights = _position(64, 8, 1.0, 0)
    assert native.read(probs.double(), logits, hidden, weights) is None
    assert native.read(probs, logits, torch.randn(8, 2)[:, 0], weights) is None  # strided
    assert native.read(probs, logits[:32], hidden, weights) is None
    assert native.read(probs, logits, hidden, weights[:4]) is None
    masked = logits.clone()
    masked[3] = float("-inf")  # a reduced vocabulary's logits
    assert native.read(torch.softmax(masked, -1), masked, hidden, weights) is None


def test_threads_reading_at_once_each_get_their_own_reads(native):
    """The C call releases the GIL: two threads reading different positions at once must not
    see each other's numbers (a serving replica decodes requests in threads)."""
    positions = [_position(4096, 128, 1.0, seed) for seed in (1, 2)]
    expected = [native.read(*pos) for pos in positions]
    assert expected[0][2] != expected[1][2]
    wrong = []

    def reader(i: int) -> None:
        for _ in range(3000):
            if native.read(*positions[i]) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=reader, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_switched_off_the_reads_are_the_tensor_calls(monkeypatch):
    nr.native_reads.cache_clear()
    monkeypatch.setenv("SPECBOUND_NATIVE", "0")
    try:
        assert nr.native_reads() is None
    finally:
        nr.native_reads.cache_clear()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_throughput_decides_the_same_with_either_reads(
    native, embedded_pair, embedded_artifacts, fib_ids, monkeypatch, temperature
):
    def steps():
        policy = make_policy("throughput", embedded_artifacts)
        session = SpeculativeEngine(embedded_pair).start(
            fib_ids, policy, SamplingConfig(temperature), seed=0
        )
        for _ in range(12):
            session.step()
        return [(s.drafted, s.accepted, s.draft_forwards) for s in session.steps], policy

    calls = []
    read = type(native).read

    def counted(self, *args):
        calls.append(1)
        return read(self, *args)

    monkeypatch.setattr(type(native), "read", counted)
    compiled, policy = steps()
    assert calls, "the compiled reads were not used"
    monkeypatch.setattr(throughput, "native_reads", lambda: None)
    tensor, _ = steps()
    assert compiled == tensor
    assert any(d for d, *_ in compiled)
