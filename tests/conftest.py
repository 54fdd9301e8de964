"""Shared fixtures: saved tiny checkpoints (target + draft with one tokenizer)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.tiny.corpus import Document
from pipeline.tiny.training import train_tokenizer
from tests.tinymodels import tiny_model

TEXTS = [
    Document(f"d{i}", f"def f(x):\n    return x + {i}\n# the quick brown fox jumps\n")
    for i in range(50)
]


_SESSION: list[pytest.Session] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSION.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End a process that started Ray without the interpreter's finalisation. Several tests start
    and shut down a Ray cluster in this process; threads of the earlier sessions outlive
    ray.shutdown() (Serve's router loop, Ray Data's prefetchers; ray-project/ray#31145: they
    hold core-worker state a later session freed), and once in CI the interpreter crashed in
    its finalisation (SIGSEGV) after all tests had passed and every report was written. The
    verdict is final here, so the process exits with it."""
    if "ray" not in sys.modules or not _SESSION:
        return
    status = int(_SESSION[-1].exitstatus)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    os._exit(status)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module of many tiny forwards: more intra-op threads only contend on a busy 2-core
    machine (10-20x slower). Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_draft(vocab_size: int, seed: int = 1):
    import torch

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def save_checkpoint(path: Path, model, tokenizer) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@dataclass(frozen=True)
class TinyCheckpoints:
    root: Path
    target: Path
    draft: Path
    tokenizer: object


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer) -> TinyCheckpoints:
    root = tmp_path_factory.mktemp("ckpt")
    vocab = len(tokenizer)
    target = save_checkpoint(root / "target", tiny_model("qwen3_moe", vocab_size=vocab), tokenizer)
    draft = save_checkpoint(root / "draft", tiny_draft(vocab), tokenizer)
    return TinyCheckpoints(root, target, draft, tokenizer)


# The embedded models and their committed artifacts, for the policy tests that run them.
@pytest.fixture(scope="module")
def embedded_pair():
    from pipeline.models.loading import load_pair

    return load_pair()


@pytest.fixture(scope="module")
def embedded_artifacts():
    from pipeline.decode.policies.artifacts import load_artifacts

    return load_artifacts()


@pytest.fixture(scope="module")
def fib_ids(embedded_pair) -> list[int]:
    """A code prompt the embedded draft continues well (its chains are long)."""
    text = "def fib(n):\n    if n < 2:\n"
    return embedded_pair.tokenizer(text, add_special_tokens=False)["input_ids"]
