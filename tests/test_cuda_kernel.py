"""The Triton steer (``cuda_kernel=True``) computes what the PyTorch ops compute, on a GPU.

The tests that need CUDA skip without it (CI has none; they run on a GPU machine); the
refusals run everywhere.
"""

import pytest
import torch

import gss
from gss.errors import GSSError
from gss.hf.forward import cache_argument, returned_cache
from gss.steering import cuda_kernel
from gss.steering.gated import GatedSteer

from .conftest import calibrated_llama, random_ids

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
D, K = 200, 5  # d not a power of two: the kernel's masked tail


def _steers(gate: str, seed: int = 0) -> tuple[GatedSteer, GatedSteer]:
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn(K, D, generator=gen)
    steer = torch.nn.functional.normalize(torch.randn(K, D, generator=gen), dim=-1)
    thresholds = torch.rand(K, generator=gen) * 2 + 10  # about half the rows stay closed
    offset = torch.randn(K, generator=gen) * 0.1
    args = (probe, steer, thresholds, offset)
    return GatedSteer(*args, gate=gate), GatedSteer(*args, gate=gate, cuda_kernel=True)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["hard", "none"])
@pytest.mark.parametrize("shape", [(1, 1, D), (16, 1, D), (2, 40, D)])
def test_kernel_equals_the_ops_and_leaves_closed_rows_untouched(dtype, gate, shape):
    ops, kernel = _steers(gate)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=gen) * 0.5).to("cuda", dtype)
    for _ in range(2):  # the first call is the checked one, then the fast paths
        expected, got = ops(None, (), x), kernel(None, (), x)
    assert kernel._fast is not None and kernel._fast.__name__ == "steer_kernel"
    assert got.dtype == dtype and got.shape == x.shape
    if shape[0] * shape[1] > cuda_kernel.SMALL_ROWS:
        assert torch.equal(got, expected)  # a prompt pass runs the same ATen ops
    else:  # sums in another order: equal to float32 rounding, then one rounding to dtype
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    closed = (expected == x).all(-1)
    if gate == "hard" and closed.numel() > 1:
        assert closed.any() and not closed.all(), "the data should open some gates, not all"
    assert torch.equal(got[closed], x[closed])  # a closed gate: bit-for-bit the input


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, K])
def test_the_direct_launch_writes_what_tritons_launch_writes(dtype, k):
    """After its first call a bound steer launches the compiled kernel itself; it writes the
    bits Triton's own launch writes, for any number of decode rows, and an input Triton's
    specialisation does not cover (a pointer off its 16-byte alignment) takes Triton's
    launch."""
    gen = torch.Generator().manual_seed(k)
    probe_t = (torch.randn(D, k, generator=gen) * 0.2).cuda()
    neg_offset = (torch.randn(k, generator=gen) * 0.1).cuda()
    neg_steer = torch.randn(k, D, generator=gen).cuda()
    direct = cuda_kernel.BoundSteer(probe_t, neg_offset, neg_steer, hard=True)
    tritons = cuda_kernel.BoundSteer(probe_t, neg_offset, neg_steer, hard=True, direct_launch=False)
    for rows in (1, 16, cuda_kernel.SMALL_ROWS, 3, 1):
        x = torch.randn(rows, 1, D, generator=gen).to("cuda", dtype)
        got = direct(x)
        assert torch.equal(got, tritons(x)) and got.dtype == dtype and got.shape == x.shape
        assert not torch.equal(got, x), "the data should open some gates"
    assert direct.launch is not None and tritons.launch is None
    offset_by_one = torch.randn(D + 1, generator=gen).to("cuda", dtype)[1:].view(1, 1, D)
    assert offset_by_one.data_ptr() % cuda_kernel.ALIGN != 0
    assert torch.equal(direct(offset_by_one), tritons(offset_by_one))
    with pytest.raises(RuntimeError):
        direct(torch.randn(1, 1, D, dtype=dtype))  # on the CPU: refused, nothing launched
    with pytest.raises(RuntimeError):
        direct(torch.randn(1, 1, D + 1, device="cuda", dtype=dtype))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attached_generation_matches_on_cuda(dtype):
    model, art = calibrated_llama()
    model = model.to("cuda", dtype)
    ids = random_ids(2, 6, seed=5).cuda()
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        unsteered = model.generate(ids, **kwargs)
        with art.attach(model):
            expected = model.generate(ids, **kwargs)
        with art.attach(model, cuda_kernel=True) as handle:
            got = model.generate(ids, **kwargs)
            assert handle.hook._fast.__name__ == "steer_kernel"
    assert torch.equal(got, expected) and not torch.equal(got, unsteered)

    hook = art.make_hook(cuda_kernel=True)
    block = gss.find_decoder_blocks(model)[1]
    hidden = torch.randn(1, 1, model.config.hidden_size, device="cuda", dtype=dtype)
    hook(block, (), hidden)
    on_cpu = hidden.float().cpu()  # built for CUDA: the checked path steers a CPU tensor
    assert torch.equal(hook(block, (), on_cpu), art.make_hook()(block, (), on_cpu))
    with pytest.raises(GSSError, match="hidden size"):
        hook(block, (), torch.randn(1, 1, model.config.hidden_size + 1, device="cuda"))


@cuda
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_code_with_the_triton_steer_keeps_one_graph(backend):
    """Under torch.compile the fused closure hands dynamo the PyTorch ops, which the compiler
    fuses itself, not the Triton launch: the model stays one graph (fullgraph=True, as
    generate's decode compile asks) and computes what eager code computes."""
    import torch._dynamo

    model, art = calibrated_llama()
    model = model.to("cuda")
    ids = random_ids(2, 6, seed=5).cuda()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            with art.attach(model):
                expected = model(ids).logits
            with art.attach(model, cuda_kernel=True):
                model(ids)  # eager first: the fused closure is built, as in a server
                compiled = torch.compile(model, backend=backend, fullgraph=True)
                torch.testing.assert_close(compiled(ids).logits, expected, atol=1e-4, rtol=1e-4)
                explained = torch._dynamo.explain(model)(ids)
                assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
                    str(r.reason) for r in explained.break_reasons
                ]
    finally:
        torch._dynamo.reset()


def _sync_warnings(step) -> int:
    """How many host-device synchronizations `step()` makes (sync debug mode, warn level)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing" in str(w.message) for w in caught)


@cuda
@pytest.mark.parametrize("options", [{}, {"cuda_kernel": True}, {"track_gates": True}])
def test_a_steered_decode_step_never_waits_for_the_gpu(options):
    """A synchronization in the steer would stall every generated token: the host could no
    longer queue the next kernels while the GPU runs. The steered decode step makes exactly the
    synchronizations the unsteered one makes (transformers' own, if any), and the hook alone
    makes none."""
    model, art = calibrated_llama()
    model = model.to("cuda", torch.bfloat16)
    ids = random_ids(1, 6, seed=5).cuda()

    def decode_step():
        """A decode step after the prompt pass and one warm-up step (the steer's fast path is
        built on its first call); each call appends one more position to the cache."""
        with torch.no_grad():
            out = model(ids, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)

        cache = {cache_argument(model): returned_cache(out)}

        def step():
            with torch.no_grad():
                model(nxt, use_cache=True, **cache)

        step()
        return step

    unsteered = _sync_warnings(decode_step())
    with art.attach(model, **options) as handle:
        assert _sync_warnings(decode_step()) == unsteered
        hidden = torch.randn(1, 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        handle.hook(None, (), hidden)
        assert _sync_warnings(lambda: handle.hook(None, (), hidden)) == 0


def test_refused_for_a_steer_it_does_not_compute():
    probe, steer = torch.randn(K, D), torch.nn.functional.normalize(torch.randn(K, D), dim=-1)
    with pytest.raises(GSSError, match="cuda_kernel=True runs the fused steer"):
        GatedSteer(probe, steer, torch.ones(K), coefficient="ridge", cuda_kernel=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refused_without_cuda_with_the_fix():
    with pytest.raises(GSSError, match=r"needs a CUDA GPU.*attach without cuda_kernel"):
        _steers("hard")
