"""The compiled CPU hook (``cpu_kernel=True``) computes what the three PyTorch ops compute, and
hands everything it was not built for to the Python hook.

Building it takes ~30 s once per machine and torch version (then cached); the tests skip only
where no C++ compiler is installed.
"""

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gss
from gss.errors import GSSError
from gss.steering import cpu_kernel
from gss.steering.gated import GatedSteer, SteeredForward

from .conftest import calibrated_llama, needs_cxx, random_ids

pytestmark = needs_cxx

D, K = 48, 4


def _steers(gate: str, seed: int = 0) -> tuple[GatedSteer, GatedSteer]:
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn(K, D, generator=gen)
    steer = torch.nn.functional.normalize(torch.randn(K, D, generator=gen), dim=-1)
    thresholds = torch.rand(K, generator=gen) + 0.5
    offset = torch.randn(K, generator=gen) * 0.1
    args = (probe, steer, thresholds, offset)
    return GatedSteer(*args, gate=gate), GatedSteer(*args, gate=gate, cpu_kernel=True)


# float32 to float rounding (another summation order); a 16-bit result to one rounding step
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("gate", ["hard", "none"])
@pytest.mark.parametrize("shape", [(1, 1, D), (16, 1, D), (2, 40, D)])
def test_kernel_equals_the_three_ops_and_leaves_closed_rows_untouched(gate, shape, dtype):
    ops, compiled = _steers(gate)
    hook = compiled.forward_hook()
    assert hook is not compiled and hook.__name__ == "gss_cpu_steer_hook"
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.2).to(dtype)
    for _ in range(2):  # the Python hook: its checked call first, then its fast path
        expected, got = ops(None, (), x), hook(None, (), x)
    if shape[0] * shape[1] > cpu_kernel.SMALL_ROWS:
        assert compiled._fast is not None  # a prompt pass: the Python hook's ATen ops
        assert torch.equal(got, expected)
    else:
        assert compiled._fast is None  # the compiled hook steered it without calling back
        assert got.dtype == dtype
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    closed = (expected == x).all(-1)
    if gate == "hard" and closed.numel() > 1:
        assert closed.any() and not closed.all(), "the data should open some gates, not all"
    assert torch.equal(got[closed], x[closed])  # a closed gate: bit-for-bit the input
    assert got is not x and torch.equal(x, x.clone())  # a new tensor; the input is not written


def test_attached_generation_matches_and_other_inputs_take_the_checked_path():
    model, art = calibrated_llama()
    ids = random_ids(2, 6, seed=5)
    block = gss.find_decoder_blocks(model)[1]
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        unsteered = model.generate(ids, **kwargs)
        with art.attach(model) as handle:
            expected = model.generate(ids, **kwargs)
        with art.attach(model, cpu_kernel=True) as handle:
            assert isinstance(block.forward, SteeredForward)
            assert block.forward.hook.__name__ == "gss_cpu_steer_hook"
            got = model.generate(ids, **kwargs)
            assert handle.hook._fast is None  # every call, the prompt's too, steered in C++
        assert "forward" not in block.__dict__ and not block._forward_hooks
    assert torch.equal(got, expected) and not torch.equal(got, unsteered)

    steer = art.make_hook(cpu_kernel=True)
    hook = steer.forward_hook()
    hidden = torch.randn(1, 1, model.config.hidden_size)
    wide = hidden.double()  # not a dtype it was built for: the checked path steers it
    assert torch.equal(hook(block, (), wide), art.make_hook()(block, (), wide))
    strided = torch.randn(2, 1, 2 * model.config.hidden_size)[..., ::2]  # not contiguous
    assert torch.equal(hook(block, (), strided), art.make_hook()(block, (), strided))
    with pytest.raises(GSSError, match="hidden size"):
        hook(block, (), torch.randn(1, 1, model.config.hidden_size + 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_is_steered_in_cpp_as_by_the_ops(dtype):
    model, art = calibrated_llama()
    model.to(dtype)
    ids = random_ids(2, 40, seed=5)  # 80 rows: more than the C++ function takes
    with torch.no_grad():
        plain = model(ids).logits
        with art.attach(model):
            expected = model(ids[:, :1]).logits  # one position a row: a decode step's size
            whole = model(ids).logits
        with art.attach(model, cpu_kernel=True) as handle:
            got = model(ids[:, :1]).logits
            assert handle.hook._fast is None  # steered in C++, without calling back
            assert torch.equal(model(ids).logits, whole)  # a prompt pass: the same ops
    assert not torch.allclose(whole, plain, atol=0.1)  # the steer changes the logits
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)


def test_compiled_code_holds_the_python_steer_in_its_one_graph():
    """Dynamo cannot read the C function; while it traces, the wrapped forward calls the
    Python steer instead, so a full graph compiles (``fullgraph=True``, as generate's decode
    compile asks) and eager calls keep the C function."""
    import torch._dynamo

    model, art = calibrated_llama()
    ids = random_ids(2, 6, seed=5)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            with art.attach(model):
                expected = model(ids).logits
            with art.attach(model, cpu_kernel=True) as handle:
                compiled = torch.compile(model, backend="eager", fullgraph=True)
                torch.testing.assert_close(compiled(ids).logits, expected, atol=1e-5, rtol=1e-5)
                explained = torch._dynamo.explain(model)(ids)
                assert (explained.graph_count, explained.graph_break_count) == (1, 0)
                handle.hook._fast = None
                eager = model(ids).logits
                assert handle.hook._fast is None  # eager: the C function, no call back
            torch.testing.assert_close(eager, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()


def test_tuple_outputs_inference_mode_and_gate_tracking():
    ops, compiled = _steers("hard")
    hook = compiled.forward_hook()
    x = torch.randn(4, 1, D, generator=torch.Generator().manual_seed(3)) * 0.3
    cache = object()
    steered, rest = hook(None, (), (x, cache))[0], hook(None, (), (x, cache))[1:]
    torch.testing.assert_close(steered, ops(None, (), x), atol=1e-5, rtol=1e-5)
    assert rest == (cache,)  # transformers 4 blocks: (hidden, cache, ...), the rest kept
    with torch.inference_mode():
        inferred = torch.randn(4, 1, D, generator=torch.Generator().manual_seed(3)) * 0.3
        torch.testing.assert_close(hook(None, (), inferred), steered, atol=0, rtol=0)
    compiled.track_gates = True  # only the Python hook counts gates: every call goes there
    torch.testing.assert_close(hook(None, (), x), steered, atol=1e-5, rtol=1e-5)
    assert compiled.gate_stats()["tokens"] == 4
    compiled.track_gates = False
    hook(None, (), x)
    assert compiled.gate_stats()["tokens"] == 4


def test_dispatch_modes_see_the_steer_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ops, compiled = _steers("hard")
    x = torch.randn(2, 1, D)
    with Recorder() as recorder:
        got = compiled.forward_hook()(None, (), x)
    assert any("addmm" in op for op in recorder.ops)  # the Python hook's ops, visible
    assert torch.equal(got, ops(None, (), x))


def test_a_removed_hook_frees_its_steer():
    _, compiled = _steers("hard")
    block = torch.nn.Identity()
    handle = gss.steering.gated.register(block, compiled)
    block(torch.randn(1, 1, D))
    alive = weakref.ref(compiled)
    handle.remove()
    del compiled, handle
    gc.collect()
    assert alive() is None  # the C hook held the Python one; removing it released both


def test_gradients_flow_as_through_the_three_ops():
    ops, compiled = _steers("hard")
    hook = compiled.forward_hook()
    x = torch.randn(3, 1, D, generator=torch.Generator().manual_seed(2)) * 0.3
    grads = []
    for steer in (ops, hook):
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


def test_a_build_killed_midway_does_not_hang_the_next(monkeypatch, tmp_path):
    # torch marks a build in progress with a `lock` file and waits for it to go; a killed
    # build leaves it, and torch would then wait forever
    import torch.utils.cpp_extension as ext

    build = tmp_path / cpu_kernel._name()
    build.mkdir()
    (build / "lock").touch()

    def fake_build(name, build_directory, **kwargs):
        assert not (Path(build_directory) / "lock").exists()  # where torch would have waited
        return SimpleNamespace(make_hook="the hook")

    monkeypatch.setattr(ext, "load_inline", fake_build)
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv("GSS_KERNEL_DIR", str(tmp_path))
    assert cpu_kernel.load() == "the hook"
