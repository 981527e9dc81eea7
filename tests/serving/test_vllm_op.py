"""The vLLM plugin's steered layer and its op ``gss::vllm_steer`` on their own, without vLLM:
each token steered by the artifact of its slot, the others left bit for bit (a Llama-family
block's hidden and residual both); and, on a GPU, the same inside a captured CUDA graph and
under ``torch.compile(mode="reduce-overhead")`` (inductor + CUDA graphs), with the slots
rewritten in place between replays as the plugin's runner patch does before every forward.
With torch's ops and with the op's Triton kernel (`steer_with`: where Triton is installed; on
a CPU in Triton's interpreter, as `make test-vllm` runs this module a second time).
vLLM itself is tested in tests/vllm (its own environment, CPU only here)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gss
from gss.serving import vllm_op, vllm_plugin, vllm_settings

from ..helpers import random_ids, tiny_model

LAYER = 1
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two artifacts at one block of a tiny Llama (slot 0: hard gate, slot 1: ungated) and the
    block's output for a few rows, where some gates are open and some are not."""
    root = tmp_path_factory.mktemp("gss-vllm-op")
    model, reference = tiny_model("llama", seed=0, layers=3), tiny_model("llama", seed=1, layers=3)
    rows = random_ids(32, 16, seed=0)
    art = gss.calibrate(model, reference, rows, layer=LAYER, rank=2, progress=False)
    art = art.with_options(delta=25.0)
    art.save_pretrained(root / "a")
    art.with_options(gate="none").save_pretrained(root / "b")
    captured: list[torch.Tensor] = []
    _, block = gss.hf.blocks.resolve_layer(model, LAYER)

    def keep(module: Any, args: Any, out: Any) -> None:  # transformers 4: (hidden, ...)
        captured.append((out[0] if isinstance(out, tuple) else out).detach())

    handle = block.register_forward_hook(keep)
    with torch.no_grad():
        model(random_ids(3, 8, seed=1))
    handle.remove()
    return {"root": root, "hidden": captured[0].reshape(-1, captured[0].shape[-1])}


@pytest.fixture
def state(
    artifacts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Any:
    """The plugin's state serving both artifacts at LAYER (slots 0 and 1), or, parametrized
    ``"a"``, the one (slot 0: the op's form for a layer with one artifact)."""
    state = vllm_op.State()
    root: Path = artifacts["root"]
    names = getattr(request, "param", "a+b").split("+")
    state.load({name: str(root / name) for name in names})
    assert state.names == {name: slot for slot, name in enumerate(names)}
    monkeypatch.setattr(vllm_op, "STATE", state)
    return state


one_or_two = pytest.mark.parametrize("state", ["a", "a+b"], indirect=True)


@pytest.fixture(params=["torch", "triton"])
def steer_with(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """What the op steers with once the state is prepared: torch's ops, or the Triton kernel
    (`gss.serving.triton_steer`; where Triton is installed, as in vLLM's environments: on CUDA,
    or on a CPU in Triton's interpreter)."""
    if request.param == "torch":
        monkeypatch.setenv(vllm_settings.TRITON_ENV, "0")
        return "torch"
    pytest.importorskip("triton")
    params = getattr(request.node, "callspec", None)
    device = params.params.get("device", "cpu") if params is not None else "cpu"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device == "cpu" and not interpreted:  # Triton must know before it is imported
        pytest.skip("the Triton kernel runs on a CPU in Triton's interpreter: TRITON_INTERPRET=1")
    if device == "cuda" and interpreted:
        pytest.skip("the Triton kernel runs in Triton's interpreter here, on CPU tensors only")
    monkeypatch.setenv(vllm_settings.TRITON_ENV, "1")
    return "triton"


def _expected(state: Any, total: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Row by row: the artifact of the token's slot applied by gss's hook, else unchanged."""
    rows = []
    for row, slot in zip(total, slots.tolist(), strict=True):
        if slot < 0:
            rows.append(row)
            continue
        ((_, hook),) = [entry for entry in state.by_layer[LAYER] if entry[0] == slot]
        rows.append(hook.steer_hidden(row.unsqueeze(0))[0][0])
    return torch.stack(rows)


def _small_residual(hidden: torch.Tensor) -> torch.Tensor:
    """Small enough that the gates stay open on some tokens and closed on others."""
    noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3))
    return (0.01 * noise).to(hidden.device, hidden.dtype)


def _patterns(n: int, device: torch.device) -> list[torch.Tensor]:
    mixed = torch.tensor([-1, 0, 1], dtype=torch.int32).repeat(n // 3 + 1)[:n]
    return [
        p.to(device)
        for p in (
            mixed,
            torch.full((n,), -1, dtype=torch.int32),
            mixed.flip(0),
            torch.zeros_like(mixed),
        )
    ]


class _Block(torch.nn.Module):
    """A stand-in for a vLLM decoder layer: returns its input, as one tensor or as
    Llama's (hidden, residual)."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return hidden if residual is None else (hidden, residual)


def _layer() -> torch.nn.Module:
    """The block as the plugin's install leaves it: its steered subclass, at LAYER."""
    layer = vllm_op.steered_class(_Block)()
    layer._gss_layer = LAYER
    return layer


def _op(hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """What the steered layer hands on: its one output, or its (hidden, residual)."""
    out = _layer()(hidden, residual)
    return (out,) if residual is None else tuple(out)


@one_or_two
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_each_token_gets_the_steer_of_its_slot(state, artifacts, device, with_residual, steer_with):
    hidden = artifacts["hidden"].to(device)
    n = hidden.shape[0]
    state.prepare(torch.device(device), hidden.dtype, n)
    assert bool(state.kernels) == (steer_with == "triton")
    residual = _small_residual(hidden) if with_residual else None
    total = hidden if residual is None else hidden + residual
    hooks = dict(state.by_layer[LAYER])
    assert (hooks[0].steer_hidden(total)[0] != total).any(dim=-1).float().mean() < 1  # gates
    slots = state.buffer(n, torch.device(device))
    for pattern in _patterns(n, torch.device(device)):
        pattern[pattern >= len(hooks)] = vllm_op.NO_SLOT  # a slot this state serves
        slots[:n].copy_(pattern)
        got = _op(hidden, residual)
        want = _expected(state, total, pattern.cpu())
        unsteered, steered = pattern < 0, pattern >= 0
        assert torch.equal(got[0][unsteered], hidden[unsteered])  # bit for bit
        if residual is not None:  # and the residual too, for the next layer to add
            assert torch.equal(got[1][unsteered], residual[unsteered])
            assert not got[1][steered].any()  # a steered token's sum is in the hidden
        torch.testing.assert_close(sum(got), want, rtol=1e-5, atol=1e-5)
        if steered.any():
            assert not torch.equal(sum(got), total)


def test_unsteered_tokens_keep_their_bfloat16_hidden_and_residual(state, artifacts, steer_with):
    """vLLM's fused add-RMSNorm adds a layer's hidden and residual in float32: the op hands
    an unsteered token's two bfloat16 outputs on as they are, not their sum rounded to
    bfloat16 (which changed unsteered requests of a bfloat16 engine before)."""
    hidden = artifacts["hidden"].to(torch.bfloat16)
    n = hidden.shape[0]
    residual = (100 * _small_residual(hidden)).to(torch.bfloat16)  # sums that round
    rounded = (hidden + residual).float() != hidden.float() + residual.float()
    assert rounded.any(), "no sum rounds in bfloat16: no test"
    state.prepare(torch.device("cpu"), torch.bfloat16, n)
    pattern = _patterns(n, torch.device("cpu"))[0]
    state.buffer(n, torch.device("cpu"))[:n].copy_(pattern)
    out_h, out_r = _op(hidden, residual)
    unsteered = pattern < 0
    assert torch.equal(out_h[unsteered], hidden[unsteered])
    assert torch.equal(out_r[unsteered], residual[unsteered])
    assert not torch.equal(out_h[~unsteered], hidden[~unsteered])


def test_a_batch_dimension_of_one_holds_the_tokens(state, artifacts, steer_with):
    """vLLM runs some models (GPT-NeoX, Phi, OLMo, SmolLM3, ...) through its Transformers
    backend, whose layers see the batch as 1 x tokens x hidden: every token still gets its own
    slot's steer, as with the tokens x hidden of vLLM's own models (not the first token's
    slot for all, which steered unsteered requests of a mixed batch before)."""
    hidden = artifacts["hidden"]
    n = hidden.shape[0]
    state.prepare(torch.device("cpu"), hidden.dtype, n)
    slots = state.buffer(n, torch.device("cpu"))
    layer = _layer()
    for pattern in _patterns(n, torch.device("cpu")):
        slots[:n].copy_(pattern)
        flat, batched = layer(hidden), layer(hidden.unsqueeze(0))
        assert batched.shape == (1, *hidden.shape)
        assert torch.equal(batched[0], flat)
        torch.testing.assert_close(flat, _expected(state, hidden, pattern), rtol=1e-5, atol=1e-5)
        assert torch.equal(flat[pattern < 0], hidden[pattern < 0])


def _eager(hidden, residual, slots, pattern):
    n = hidden.shape[0]
    slots[:n].copy_(pattern)
    return [t.clone() for t in _op(hidden, residual)]


@one_or_two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_in_a_cuda_graph_the_op_reads_slots_written_in_place(
    state, artifacts, dtype, device, steer_with
):
    """Captured once, replayed with new slots and new inputs copied into the captured
    buffers: every replay equals the op run eagerly, bit for bit (the same kernels). As in the
    plugin's runner, the steers are prepared first and the slots are written through
    ``buffer()`` before every step, asked for by the runner's device ``cuda``, not ``cuda:0``."""
    device = torch.device(device)  # what a runner may hold; tensors say cuda:0
    hidden = artifacts["hidden"].to(device, dtype)
    n = hidden.shape[0]
    residual = _small_residual(hidden)
    state.prepare(device, dtype, 64)
    slots = state.buffer(n, device)
    static_h, static_r = hidden.clone(), residual.clone()
    slots[:n].copy_(_patterns(n, device)[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: builds the fused steer of this device and dtype
        for _ in range(2):
            _op(static_h, static_r)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _op(static_h, static_r)
    for i, pattern in enumerate(_patterns(n, device)):
        h, r = hidden * (1 + i / 4), residual.flip(0)  # new inputs too
        static_h.copy_(h)
        static_r.copy_(r)
        slots = state.buffer(n, device)
        slots[:n].copy_(pattern)
        graph.replay()
        torch.cuda.synchronize()
        want = _eager(h, r, slots, pattern)
        for got, expected in zip(out, want, strict=True):
            assert torch.equal(got, expected), f"pattern {i}"
        assert torch.equal(out[0][pattern < 0], h[pattern < 0])
        assert torch.equal(out[1][pattern < 0], r[pattern < 0])


@one_or_two
@pytest.mark.parametrize(
    "device, freezing",
    [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=needs_cuda)],
)
def test_torch_compile_keeps_the_op_and_reads_the_slots_in_place(
    state, artifacts, device, freezing, steer_with
):
    """vLLM compiles the model with the op in the graph (and on a GPU runs it as CUDA
    graphs): here the same with inductor (on CUDA with its cudagraph trees,
    ``reduce-overhead``) and no graph break, the slots rewritten in place between calls. Also
    with inductor freezing the model (vLLM's CPU runner does under ``max_autotune``), which
    makes constants of the tensors the traced code reads: the op reads the slots itself."""
    device = torch.device(device)
    hidden = artifacts["hidden"].to(device)
    n = hidden.shape[0]
    residual = _small_residual(hidden)
    state.prepare(device, hidden.dtype, 64)  # as the plugin's install does before vLLM's warm-up

    layer = _layer()

    def step(h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        out_h, out_r = layer(h * 1.0, r)
        return torch.stack([out_h, out_r]) * 2.0  # exact in floating point

    mode = "reduce-overhead" if device.type == "cuda" else None
    compiled = torch.compile(step, mode=mode, fullgraph=True)
    frozen = torch._inductor.config.patch(freezing=freezing)
    for i, pattern in enumerate(_patterns(n, device) * 2):  # warm-up, record, then replays
        h = hidden * (1 + i / 4)
        slots = state.buffer(n, device)
        slots[:n].copy_(pattern)
        with frozen, torch.no_grad():  # freezing applies to inference only
            got = compiled(h, residual).clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        want = torch.stack(_eager(h, residual, slots, pattern))
        assert torch.equal(got, 2.0 * want), f"call {i}"


@pytest.mark.parametrize("gate, rank, width", [("hard", 3, 4100), ("none", 1, 96)])
def test_the_triton_kernel_is_the_fused_steer(gate, rank, width):
    """`gss.serving.triton_steer` against the steer `gss.steer` runs (its fused torch form),
    row by row: any rank (padded to a power of two), rows wider than one block of the kernel
    (read in chunks), a residual added first (rounded to the hidden's dtype), rows of another
    slot left alone or passed through. Where there is no GPU, in Triton's interpreter."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpreted:
        pytest.skip("the Triton kernel runs on a CPU in Triton's interpreter: TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    from gss.serving.triton_steer import TritonSteer
    from gss.steering.gated import GatedSteer

    device = torch.device("cpu" if interpreted else "cuda")
    g = torch.Generator().manual_seed(rank)
    probe = torch.randn(rank, width, generator=g) / width**0.5
    steer = torch.nn.functional.normalize(torch.randn(rank, width, generator=g), dim=-1)
    hook = GatedSteer(probe, steer, torch.linspace(1.5, 3.0, rank), gate=gate)
    assert GatedSteer(probe, steer, torch.ones(rank), gate="relu").folded(device) is None
    folded = hook.folded(device)
    assert folded is not None
    probe_f, offset_f, steer_f, hard = folded
    kernel = TritonSteer(probe_f, offset_f, steer_f, hard=hard)
    hidden = 2 * torch.randn(7, width, generator=g).to(device)
    residual = 0.1 * torch.randn(7, width, generator=g).to(device)
    slots = torch.tensor([0, -1, 0, 1, 0, 0, -1, 5], dtype=torch.int32, device=device)
    mine = slots[:7] == 0
    for extra, total in ((None, hidden), (residual, hidden + residual)):
        want = hook.steer_hidden(total)[0]
        if gate == "hard":  # the gates: open on some rows and closed on others
            assert 0 < (want != total).any(-1).sum() < 7
        for pass_through in (False, True):
            out, hit = kernel(hidden, extra, slots, 0, pass_through=pass_through)
            assert hit.shape == (7, 1) and torch.equal(hit[:, 0], mine)
            torch.testing.assert_close(out[mine], want[mine], rtol=1e-5, atol=1e-5)
            if pass_through:
                assert torch.equal(out[~mine], total[~mine])


def test_the_triton_op_refuses_more_tokens_than_its_slot_buffer(state, artifacts, steer_with):
    """The kernel reads each token's slot from the buffer: a forward of more tokens than the
    buffer holds is an error naming the sizes, not a read past its end (torch's form fails on
    the shapes)."""
    if steer_with == "torch":
        pytest.skip("torch's ops fail on the shapes themselves")
    hidden = artifacts["hidden"]
    state.prepare(torch.device("cpu"), hidden.dtype, 4)  # fewer tokens than this forward's
    assert state.slots is not None and state.slots.shape[0] == 4 < hidden.shape[0]
    with pytest.raises(RuntimeError, match="more than the 4"):
        _op(hidden, None)


def test_a_kernel_that_does_not_run_leaves_its_layer_to_torch(
    state, artifacts, steer_with, monkeypatch, caplog
):
    """The kernels are compiled when the state is prepared (before vLLM's warm-up and graph
    capture). One that fails there (a Triton it does not suit) leaves its layer to torch's
    ops, with a warning, and the op still steers; with ``GSS_VLLM_TRITON=1`` it is an error."""
    if steer_with == "torch":
        pytest.skip("the Triton kernel's failure")
    from gss.errors import GSSError
    from gss.serving import triton_steer

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no such PTX version")

    monkeypatch.setattr(triton_steer.TritonSteer, "__call__", fails)
    hidden = artifacts["hidden"]
    with pytest.raises(GSSError, match="GSS_VLLM_TRITON=1 but gss's Triton kernel does not run"):
        state.prepare(torch.device("cpu"), hidden.dtype, hidden.shape[0])
    monkeypatch.setattr(vllm_op, "use_triton", lambda device, dtype: True)  # auto, on CUDA
    monkeypatch.delenv(vllm_settings.TRITON_ENV)
    with caplog.at_level("WARNING", logger="vllm.gss"):
        state.prepare(torch.device("cpu"), hidden.dtype, hidden.shape[0])
    assert state.kernels == {} and vllm_op.steer_kernels() == "torch's ops"
    assert "no such PTX version" in caplog.text and "steers with torch's ops" in caplog.text
    slots = state.buffer(hidden.shape[0], torch.device("cpu"))
    slots.fill_(0)
    want = _expected(state, hidden, slots)
    torch.testing.assert_close(_op(hidden, None)[0], want, rtol=1e-5, atol=1e-5)


def test_use_triton_reads_its_environment_variable(monkeypatch):
    """``GSS_VLLM_TRITON``: unset (auto) the kernel steers on CUDA only; 0 never; 1 on a CPU
    needs Triton's interpreter; anything else is refused, naming the values it takes."""
    from gss.errors import GSSError

    cpu = torch.device("cpu")
    monkeypatch.delenv(vllm_settings.TRITON_ENV, raising=False)
    assert not vllm_op.use_triton(cpu, torch.float32)
    monkeypatch.setenv(vllm_settings.TRITON_ENV, "0")
    assert not vllm_op.use_triton("cuda", torch.float32)
    monkeypatch.setenv(vllm_settings.TRITON_ENV, "yes")
    with pytest.raises(GSSError, match="give 0"):
        vllm_op.use_triton(cpu, torch.float32)
    monkeypatch.setenv(vllm_settings.TRITON_ENV, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(GSSError, match="TRITON_INTERPRET=1"):
        vllm_op.use_triton(cpu, torch.float32)


def test_prepare_keeps_one_slot_buffer_and_puts_the_steers_in_place(state):
    state.prepare(torch.device("cpu"), torch.float32, 16)
    slots = state.buffer(16, torch.device("cpu"))
    assert state.buffer(3, "cpu") is slots  # captured graphs read this tensor every step
    for entries in state.by_layer.values():
        for _, hook in entries:
            assert torch.device("cpu") in hook._on
            assert not hook._fused or (torch.device("cpu"), torch.float32) in hook._fused_by


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_fill_slots_gives_each_token_its_requests_slot(state, device):
    """What the runner patch writes before a forward: each scheduled token the slot of its
    request (by ``query_start_loc``), in place in the one buffer, padding up to the
    runner's token budget unsteered (on CUDA the copy goes through pinned memory); each
    request's slot looked up once."""
    from types import SimpleNamespace

    import numpy as np

    def params(name: str | None) -> Any:
        return SimpleNamespace(extra_args=None if name is None else {vllm_settings.EXTRA_ARG: name})

    requests = {"r0": params("a"), "r1": params(None), "r2": params("b"), "r3": params("none")}
    runner = SimpleNamespace(
        device=torch.device(device),
        max_num_tokens=12,
        requests={rid: SimpleNamespace(sampling_params=p) for rid, p in requests.items()},
    )
    state.prepare(torch.device(device), torch.float32, 12)
    slots = state.buffer(12, torch.device(device))
    looked_up: list[Any] = []
    slot_of = state.slot_of
    state.slot_of = lambda p: looked_up.append(p) or slot_of(p)
    steps = [
        (["r0", "r1", "r2", "r3"], [0, 3, 4, 8, 9], [0, 0, 0, -1, 1, 1, 1, 1, -1]),
        (["r2", "r0"], [0, 1, 2], [1, 0]),  # decode: one token each, a new order
    ]
    for req_ids, starts, want in steps:
        runner.input_batch = SimpleNamespace(num_reqs=len(req_ids), req_ids=req_ids)
        runner.query_start_loc = SimpleNamespace(np=np.array(starts, dtype=np.int32))
        vllm_plugin._fill_slots(runner)
        assert state.buffer(12, torch.device(device)) is slots  # captured graphs read this one
        expected = want + [vllm_op.NO_SLOT] * (12 - len(want))
        assert slots.cpu().tolist() == expected
    assert len(looked_up) == 4  # once a request: its slot is kept on it for its later steps

    # the same batch again (a steady decode): the buffer already holds its slots, so nothing is
    # written (a row changed behind the plugin's back stays as it is); after a clear, all again
    slots[5] = 7
    vllm_plugin._fill_slots(runner)
    assert slots.cpu().tolist()[:6] == [1, 0, -1, -1, -1, 7]
    state.clear()
    assert slots.cpu().tolist() == [vllm_op.NO_SLOT] * 12
    vllm_plugin._fill_slots(runner)
    assert slots.cpu().tolist() == [1, 0] + [vllm_op.NO_SLOT] * 10


def test_v1_runner_keeps_the_slots_between_forwards_and_clears_them_for_a_dummy_run(state):
    """The V1 runner patch: each forward reads its batch's slots; they stay in the buffer
    after it (the next step rewrites only what changed), and a dummy run (warm-up, CUDA-graph
    capture, an idle data-parallel rank) reads none."""
    from types import SimpleNamespace as NS

    import numpy as np

    no = vllm_op.NO_SLOT
    sampling = NS(extra_args={vllm_settings.EXTRA_ARG: "b"})

    class Runner:  # the V1 runner's methods and fields the patch uses, as stand-ins
        def __init__(self) -> None:
            self.model = NS(_gss_installed=True)
            self.device, self.max_num_tokens = torch.device("cpu"), 4
            self.requests = {"r": NS(sampling_params=sampling), "s": NS(sampling_params=None)}
            self.seen: list[list[int]] = []

        def step(self, req_ids: list[str], starts: list[int]) -> None:
            self.input_batch = NS(num_reqs=len(req_ids), req_ids=req_ids)
            self.query_start_loc = NS(np=np.array(starts, dtype=np.int32))
            self._model_forward()

        def read(self) -> None:  # what the model's op reads
            assert state.slots is not None
            self.seen.append(state.slots.tolist())

        def _model_forward(self) -> None:
            self.read()

        def _dummy_run(self) -> None:  # the model, called outside _model_forward
            self.read()

    vllm_plugin._patch_runner_class(Runner)
    runner = Runner()
    state.prepare(runner.device, torch.float32, 4)
    runner.step(["r", "s"], [0, 2, 3])
    runner.step(["r", "s"], [0, 1, 2])
    assert state.slots.tolist() == [1, no, no, no]  # kept after the forward, for the next step
    runner._dummy_run()
    runner.step(["r"], [0, 1])
    assert runner.seen == [[1, 1, no, no], [1, no, no, no], [no] * 4, [1, no, no, no]]


def test_a_steady_step_reads_no_slot_and_a_reused_request_id_is_looked_up_again(state):
    """A step of the same requests with as many tokens each as the last one (a steady decode)
    returns before reading any request's slot; when a request comes or goes (V1's
    ``_update_states`` with new or finished requests), the next step looks every slot up
    again: vLLM takes an aborted request's id back for a new request, which may name another
    artifact, at the same place in the batch with as many tokens."""
    from types import SimpleNamespace as NS

    import numpy as np

    no = vllm_op.NO_SLOT

    def request(name: str | None) -> Any:
        return NS(sampling_params=NS(extra_args={vllm_settings.EXTRA_ARG: name} if name else None))

    class Runner:  # the V1 runner's methods and fields the patch uses, as stand-ins
        def __init__(self) -> None:
            self.model = NS(_gss_installed=True)
            self.device, self.max_num_tokens = torch.device("cpu"), 4
            self.requests = {"r": request("b"), "s": request(None)}

        def _update_states(self, scheduler_output: Any) -> None:
            for req_id in scheduler_output.finished_req_ids:
                del self.requests[req_id]
            for new in scheduler_output.scheduled_new_reqs:
                self.requests[new.req_id] = request(new.name)

        def step(self, req_ids: list[str], starts: list[int], new=(), finished=()) -> None:
            self._update_states(NS(scheduled_new_reqs=list(new), finished_req_ids=set(finished)))
            self.input_batch = NS(num_reqs=len(req_ids), req_ids=req_ids)
            self.query_start_loc = NS(np=np.array(starts, dtype=np.int32))
            self._model_forward()

        def _model_forward(self) -> None: ...

    vllm_plugin._patch_runner_class(Runner)
    runner = Runner()
    state.prepare(runner.device, torch.float32, 4)
    looked_up: list[Any] = []
    slot_of = state.slot_of
    state.slot_of = lambda p: looked_up.append(p) or slot_of(p)
    runner.step(["r", "s"], [0, 1, 2])
    assert state.slots.tolist() == [1, no, no, no] and len(looked_up) == 2
    read: list[str] = []
    requests = runner.requests
    # a steady step reads no request
    runner.requests = type("Spy", (dict,), {"__getitem__": lambda d, k: read.append(k)})(requests)
    runner.step(["r", "s"], [0, 1, 2])
    assert read == [] and state.slots.tolist() == [1, no, no, no]
    runner.requests = requests
    # "r" aborted, and its id back at once for a request naming artifact "a": same ids, same
    # token counts, another slot
    runner.step(["r", "s"], [0, 1, 2], new=[NS(req_id="r", name="a")], finished=["r"])
    assert state.slots.tolist() == [0, no, no, no]


def test_model_runner_v2_keeps_each_requests_slot_from_add_to_remove(state):
    """vLLM's Model Runner V2 has no ``requests`` dict and no ``_model_forward``: the patch
    looks a request's slot up when ``add_requests`` adds it (a resumed request comes back as
    new), drops it in ``_remove_request``, writes the batch's slots after ``prepare_inputs``
    (its ``req_ids`` in order, ``query_start_loc_np``) and keeps them for the next step; a
    dummy run (``execute_model(dummy_run=True)``: warm-up, profiling, an idle data-parallel
    rank) and CUDA-graph capture (``capture_model``, which calls the model itself) read none."""
    from types import SimpleNamespace as NS

    import numpy as np

    def new(req_id: str, name: str | None) -> Any:
        extra = None if name is None else {vllm_settings.EXTRA_ARG: name}
        return NS(req_id=req_id, sampling_params=NS(extra_args=extra))

    class Runner:  # V2's methods the patch wraps, as stand-ins
        def __init__(self) -> None:
            self.model = NS(_gss_installed=True)
            self.device, self.max_num_tokens = torch.device("cpu"), 10
            self.removed: list[str] = []
            self.seen: list[list[int]] = []

        def load_model(self) -> None: ...

        def add_requests(self, scheduler_output: Any) -> None: ...

        def _remove_request(self, req_id: str) -> bool:
            self.removed.append(req_id)
            return True

        def prepare_inputs(self, req_ids: list[str], starts: list[int]) -> Any:
            return NS(num_reqs=len(req_ids), req_ids=req_ids, query_start_loc_np=np.array(starts))

        def execute_model(self, req_ids: list[str], starts: list[int], dummy_run=False) -> None:
            if not dummy_run:  # V2 makes a dummy batch of its own, without prepare_inputs
                self.prepare_inputs(req_ids, starts)
            self.read()

        def capture_model(self) -> None:  # captures graphs calling the model directly
            self.read()

        def read(self) -> None:  # what the model's op reads
            assert state.slots is not None
            self.seen.append(state.slots.tolist())

    vllm_plugin._patch_v2_runner_class(Runner)
    assert Runner._gss_v2  # type: ignore[attr-defined]
    runner = Runner()
    state.prepare(runner.device, torch.float32, 10)
    runner.add_requests(NS(scheduled_new_reqs=[new("x", "a"), new("y", None), new("z", "b")]))
    runner.execute_model(["z", "x", "y"], [0, 2, 5, 6])  # chunked prefill, then a decode
    runner.add_requests(NS(scheduled_new_reqs=[new("w", "none")]))
    runner._remove_request("x")
    runner.execute_model(["y", "w", "z"], [0, 1, 2, 3])
    no = vllm_op.NO_SLOT
    steady = [no, no, 1, no, no, no, no, no, no, no]
    assert state.slots.tolist() == steady  # kept after the forward, for the next step
    runner.execute_model([], [0], dummy_run=True)
    runner.execute_model(["y", "w", "z"], [0, 1, 2, 3])
    runner.capture_model()
    first = [1, 1, 0, 0, 0, no, no, no, no, no]
    assert runner.seen == [first, steady, [no] * 10, steady, [no] * 10]
    assert runner.removed == ["x"] and "x" not in runner._gss_slots
    with pytest.raises(KeyError):  # a batch with a request never added: loud, not unsteered
        runner.execute_model(["x"], [0, 1])
