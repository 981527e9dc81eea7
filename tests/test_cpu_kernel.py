"""The compiled CPU steer (``cpu_kernel=True``) computes what the three PyTorch ops compute.

Building it takes ~30 s once per machine and torch version (then cached); the tests skip only
where no C++ compiler is installed.
"""

import shutil

import pytest
import torch

import gss
from gss import cpu_kernel
from gss.errors import GSSError
from gss.hook import GatedSteer

from .conftest import random_ids

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler to build the CPU kernel",
)

D, K = 48, 4


def _steers(gate: str, seed: int = 0) -> tuple[GatedSteer, GatedSteer]:
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn(K, D, generator=gen)
    steer = torch.nn.functional.normalize(torch.randn(K, D, generator=gen), dim=-1)
    thresholds = torch.rand(K, generator=gen) + 0.5
    offset = torch.randn(K, generator=gen) * 0.1
    args = (probe, steer, thresholds, offset)
    return GatedSteer(*args, gate=gate), GatedSteer(*args, gate=gate, cpu_kernel=True)


@pytest.mark.parametrize("gate", ["hard", "none"])
@pytest.mark.parametrize("shape", [(1, 1, D), (16, 1, D), (2, 40, D)])
def test_kernel_equals_the_three_ops_and_leaves_closed_rows_untouched(gate, shape):
    ops, compiled = _steers(gate)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.2
    for _ in range(2):  # the first call is the checked one, then the fast paths
        expected, got = ops(None, (), x), compiled(None, (), x)
    assert compiled._fast is not None and compiled._fast.__name__ == "steer_compiled"
    if shape[0] * shape[1] > cpu_kernel.SMALL_ROWS:
        assert torch.equal(got, expected)  # a prompt pass runs the same ATen ops
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    closed = (expected == x).all(-1)
    if gate == "hard" and closed.numel() > 1:
        assert closed.any() and not closed.all(), "the data should open some gates, not all"
    assert torch.equal(got[closed], x[closed])  # a closed gate: bit-for-bit the input


def test_attached_generation_matches_and_other_inputs_take_the_checked_path(make_model):
    model = make_model("llama", seed=3)
    ref = make_model("llama", seed=11)
    art = gss.calibrate(model, ref, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False)
    art = art.with_options(delta=25.0)
    ids = random_ids(2, 6, seed=5)
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        unsteered = model.generate(ids, **kwargs)
        with art.attach(model) as handle:
            expected = model.generate(ids, **kwargs)
        with art.attach(model, cpu_kernel=True) as handle:
            got = model.generate(ids, **kwargs)
            assert handle.hook._fast.__name__ == "steer_compiled"
    assert torch.equal(got, expected) and not torch.equal(got, unsteered)

    hook = art.make_hook(cpu_kernel=True)
    block = gss.find_decoder_blocks(model)[1]
    hidden = torch.randn(1, 1, model.config.hidden_size)
    hook(block, (), hidden)
    half = hidden.bfloat16()  # built for float32: the checked path steers it
    assert torch.equal(hook(block, (), half), art.make_hook()(block, (), half))
    with pytest.raises(GSSError, match="hidden size"):
        hook(block, (), torch.randn(1, 1, model.config.hidden_size + 1))


def test_gradients_flow_as_through_the_three_ops():
    ops, compiled = _steers("hard")
    x = torch.randn(3, 1, D, generator=torch.Generator().manual_seed(2)) * 0.3
    grads = []
    for steer in (ops, compiled):
        for _ in range(2):
            leaf = x.clone().requires_grad_(True)
            steer(None, (), leaf).square().sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


def test_refused_for_a_steer_it_does_not_compute():
    probe, steer = torch.randn(K, D), torch.nn.functional.normalize(torch.randn(K, D), dim=-1)
    with pytest.raises(GSSError, match="cpu_kernel=True runs the fused steer"):
        GatedSteer(probe, steer, torch.ones(K), coefficient="ridge", cpu_kernel=True)


def test_a_failed_build_says_what_it_needs(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as ext

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(ext, "load_inline", no_compiler)
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv("GSS_KERNEL_DIR", str(tmp_path))
    with pytest.raises(GSSError, match=r"C\+\+ compiler .* and ninja"):
        _steers("hard")
