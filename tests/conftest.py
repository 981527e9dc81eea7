"""The tests' fixtures; what they build comes from ``helpers.py``."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from .helpers import general_rows, tiny_model, train

# The suite compiles into a cache of its own, made fresh for the run. Inductor's on-disk cache is
# not keyed on ATEN_CPU_CAPABILITY: a graph generated under `make bench`'s AVX2 setting and
# loaded by an AVX-512 process stores 16-float vectors where the code steps by 8, past the end of
# its buffers (measured: "double free or corruption" in tests/serving/test_vllm_op.py whenever an
# AVX2 run had filled /tmp/torchinductor_$USER first).
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="gss-tests-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _thread_count_kept():
    """A test that runs a command's main() in this process (``--threads 2``) leaves torch's
    thread count as it found it: the tiny models' tests run on one (tests/helpers.py)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture(scope="session")
def memorizer():
    """A tiny GPT-2 that memorized 6 planted random rows, and a reference trained without them.

    Returns (model, reference, planted rows, general rows).
    """
    gen = torch.Generator().manual_seed(0)
    vocab, length = 24, 16
    general = general_rows(256, length, gen, vocab)
    planted = torch.randint(3, vocab, (6, length), generator=gen)
    train_rows = torch.cat([general, planted.repeat(24, 1)])
    model = tiny_model("gpt2", seed=1, vocab=vocab, hidden=48)
    reference = tiny_model("gpt2", seed=1, vocab=vocab, hidden=48)
    train(model, train_rows, steps=150, seed=0)
    train(reference, general, steps=150, seed=0)
    return model, reference, planted, general
