import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

import gss
from gss import GSSError
from gss.evaluate import perplexity
from gss.steering.attach import SteeredForward, register
from gss.steering.gated import GatedSteer

from ..helpers import calibrated_llama, random_ids


def _golden(h, U, V, eps, off, gate, coefficient, delta, ridge_delta):
    """Token-by-token reference implementation of the gated steer."""
    out = h.clone().double()
    for t in range(h.shape[0]):
        x = h[t].double()
        for k in range(U.shape[0]):
            u, v = U[k].double(), V[k].double()
            s = float(u @ x) - float(off[k])
            a = float(u @ v)
            if gate == "hard":
                is_open, beyond = abs(s) > eps[k], s - (1 if s > 0 else -1) * eps[k]
            elif gate == "relu":
                is_open, beyond = s > eps[k], s - eps[k]
            else:
                is_open, beyond = True, s
            if not is_open:
                continue
            if coefficient == "projection":
                c = beyond if gate == "relu" else s
            elif coefficient == "ridge":
                c = a * beyond / (a * a + ridge_delta)
            elif coefficient == "bounded":  # s, but never past the state's own component
                along = float(v @ x)
                c = min(max(s, min(along, 0.0)), max(along, 0.0))
            else:
                c = a / (a * a + delta)
            out[t] -= c * v
    return out


@pytest.mark.parametrize("gate", ["hard", "relu", "none"])
@pytest.mark.parametrize("coefficient", ["projection", "ridge", "paper-constant", "bounded"])
def test_matches_token_by_token_golden(gate, coefficient):
    gen = torch.Generator().manual_seed(0)
    d, k = 16, 3
    h = torch.randn(40, d, generator=gen)
    U = torch.randn(k, d, generator=gen) * 0.3
    V = torch.nn.functional.normalize(torch.randn(k, d, generator=gen), dim=1)
    eps = torch.tensor([0.5, 1.0, 1.5])
    off = torch.tensor([0.1, -0.2, 0.0])
    hook = GatedSteer(
        U, V, eps, off, gate=gate, coefficient=coefficient, delta=0.7, ridge_delta=0.3
    )
    delta, _ = hook.correction(h)
    expected = _golden(h, U, V, eps.tolist(), off, gate, coefficient, 0.7, 0.3)
    assert torch.allclose(h - delta, expected.float(), atol=1e-5)


def test_a_bounded_correction_is_never_larger_than_the_state_it_corrects():
    """However strong the probe, the bounded coefficient removes at most each orthonormal
    steer direction's own component: |dh| <= |h|, where the projection overshoots."""
    gen = torch.Generator().manual_seed(1)
    d, k = 16, 3
    h = torch.randn(200, d, generator=gen)
    U = torch.randn(k, d, generator=gen) * 100.0  # a steer 100x too strong
    V = torch.linalg.qr(torch.randn(d, k, generator=gen))[0].t()  # orthonormal rows
    eps, off = torch.full((k,), 1e-3), torch.zeros(k)
    bounded, _ = GatedSteer(U, V, eps, off, coefficient="bounded").correction(h)
    projected, _ = GatedSteer(U, V, eps, off).correction(h)
    assert (bounded.norm(dim=-1) <= h.norm(dim=-1) + 1e-5).all()
    assert (projected.norm(dim=-1) > 10 * h.norm(dim=-1)).any()
    kept = (h - bounded) @ V.t()  # each component moved toward 0, never past it
    assert ((kept * (h @ V.t())) >= -1e-4).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_closed_gates_leave_tokens_bit_identical(dtype):
    gen = torch.Generator().manual_seed(1)
    d = 8
    h = (torch.randn(2, 30, d, generator=gen) * 3).to(dtype)
    U = torch.randn(2, d, generator=gen)
    V = torch.nn.functional.normalize(torch.randn(2, d, generator=gen), dim=1)
    eps = torch.tensor([2.0, 3.0])
    hook = GatedSteer(U, V, eps)
    out = hook(None, None, h)
    is_open = hook.correction(h)[1].any(-1)
    assert 0 < int(is_open.sum()) < is_open.numel()  # some open, some closed
    assert out.dtype == dtype
    assert torch.equal(out[~is_open], h[~is_open])
    assert not torch.equal(out[is_open], h[is_open])


def _artifact_for(model, make_model, thresholds=None):
    ref = make_model("gpt2", seed=7)
    art = gss.calibrate(model, ref, random_ids(12, 16), layer=0, rank=2, progress=False)
    if thresholds is not None:
        art = dataclasses.replace(art, thresholds=thresholds)
    return art


def test_infinite_threshold_and_removal_are_exact(make_model):
    model = make_model("gpt2")
    ids = random_ids(3, 12, seed=5)
    with torch.no_grad():
        base = model(input_ids=ids).logits
    art = _artifact_for(model, make_model, thresholds=torch.full((2,), float("inf")))
    with gss.steer(model, art), torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base)
    live = art.with_options(gate="none")
    handle = live.attach(model)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, base)
    handle.remove()
    assert not handle.active
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base)


def test_context_manager_cleans_up_on_exceptions(make_model):
    model = make_model("gpt2")
    art = _artifact_for(model, make_model)
    block = gss.find_decoder_blocks(model)[0]
    with pytest.raises(RuntimeError), gss.steer(model, art):
        # inside the block's forward, not a forward hook (no nn.Module hook dispatch per call)
        assert isinstance(block.__dict__.get("forward"), SteeredForward)
        assert not block._forward_hooks
        raise RuntimeError("boom")
    assert "forward" not in block.__dict__ and not block._forward_hooks


@pytest.mark.filterwarnings("ignore:this artifact already steers")  # stacked on purpose
def test_the_next_steer_reuses_the_removed_wrapper_and_nothing_stays_alive(make_model):
    """A removed steer's wrapper stays with its block, holding nothing, and the next attach
    puts it back (compiled code knows it: test_compiled.py); a steer on top of an attached one
    gets a wrapper of its own. Dropping the model frees it: nothing of gss keeps it alive."""
    model = make_model("gpt2")
    art = _artifact_for(model, make_model)
    block = gss.find_decoder_blocks(model)[0]
    first = art.attach(model)
    wrapper = block.__dict__["forward"]
    first.remove()
    assert "forward" not in block.__dict__ and wrapper.block is None and wrapper.forward is None
    with art.attach(model), art.attach(model, track_gates=True):
        outer = block.__dict__["forward"]
        assert outer is not wrapper and outer.forward is wrapper
    with art.attach(model):
        assert block.__dict__["forward"] is wrapper
    # the inner one removed first stays in the chain, steering nothing, until the one on top
    # comes off: then both do, and the next steer reuses the kept wrapper again (removed out
    # of order over and over, no pass-through piles up)
    for _ in range(3):
        inner, on_top = art.attach(model), art.attach(model)
        inner.remove()
        assert block.__dict__["forward"].forward is wrapper and wrapper.block is block
        on_top.remove()
        assert "forward" not in block.__dict__ and wrapper.block is None
    with art.attach(model):
        assert block.__dict__["forward"] is wrapper
    ref = weakref.ref(model)
    del model, block, first, wrapper, outer, inner, on_top
    gc.collect()
    assert ref() is None


class _TupleBlock(nn.Module):
    def forward(self, x):
        return (x * 1.0, "extra")


def test_tuple_outputs_keep_their_other_items():
    block = _TupleBlock()
    hook = GatedSteer(torch.ones(1, 4), torch.ones(1, 4) / 2, torch.zeros(1), gate="none")
    handle = register(block, hook)
    h, extra = block(torch.ones(2, 4))
    handle.remove()
    assert extra == "extra"
    assert torch.allclose(h, torch.ones(2, 4) - 4 * 0.5)


def test_gate_counters(make_model):
    model = make_model("gpt2")
    art = _artifact_for(model, make_model)
    with art.attach(model, track_gates=True) as handle, torch.no_grad():
        model(input_ids=random_ids(4, 10, seed=3))
        stats = handle.gate_stats()
    assert stats["tokens"] == 40
    assert 0 <= stats["any_open_share"] <= 1 and len(stats["open_share"]) == 2
    assert stats["any_open_share"] >= max(stats["open_share"])


def test_gate_counters_skip_padding(make_model):
    """Shares over real tokens: the same however the rows are batched and padded, and while
    generating from a left-padded batch (the mask's last positions are the block's)."""
    model = make_model("llama")
    art = _artifact_for(model, make_model)
    rows = [random_ids(1, n, seed=n)[0].tolist() for n in (3, 9, 5, 12)]
    shares = []
    with art.attach(model, track_gates=True) as handle:
        for size in (1, 4):
            handle.reset_stats()
            perplexity(model, rows, batch_size=size)
            shares.append(handle.gate_stats())
        assert shares[0] == shares[1] and shares[0]["tokens"] == sum(map(len, rows))
        ids = torch.zeros(2, 6, dtype=torch.long)
        ids[0], ids[1, 3:] = random_ids(1, 6)[0], random_ids(1, 3)[0]
        mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
        handle.reset_stats()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
            )
        assert handle.gate_stats()["tokens"] == (6 + 3) + 2 * 3  # the last new token is not read
    assert not model._forward_pre_hooks  # removed with the steer


def test_hidden_size_mismatch_is_refused():
    hook = GatedSteer(torch.ones(1, 4), torch.ones(1, 4), torch.zeros(1))
    with pytest.raises(GSSError, match="hidden size 6"):
        hook(None, None, torch.ones(1, 2, 6))


def _directions(seed: int, k: int = 3, d: int = 16):
    """Random probes and unit steers (k, d), and the generator that drew them, for the rest."""
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn(k, d, generator=gen)
    return gen, probe, torch.nn.functional.normalize(torch.randn(k, d, generator=gen), dim=-1)


@pytest.mark.parametrize("gate", ["hard", "none"])
def test_fused_steer_counts_gates_without_changing_its_output_and_leaves_closed_tokens_exact(gate):
    gen, probe, steer = _directions(0)
    k, d = probe.shape
    eps, offset = torch.tensor([4.0, 6.0, 8.0]), torch.randn(k, generator=gen)
    hidden = torch.randn(2, 6, d, generator=gen)
    fused = GatedSteer(probe, steer, eps, offset, gate=gate)
    masked = GatedSteer(probe, steer, eps, offset, gate=gate, track_gates=True)
    assert fused._fused and masked._fused  # the paper's case runs fused, tracked or not
    ours, none = fused.steer_hidden(hidden)
    theirs, is_open = masked.steer_hidden(hidden)
    assert none is None and is_open is not None
    assert torch.equal(ours, theirs)
    if gate == "hard":
        closed = ~is_open.any(-1)
        assert closed.any() and (~closed).any()
        assert torch.equal(ours[closed], hidden[closed])
    low, _ = fused.steer_hidden(hidden.bfloat16())
    assert low.dtype == torch.bfloat16


@pytest.mark.parametrize("gate", ["hard", "none"])
def test_fast_path_after_the_first_call_is_exact_and_falls_back_on_anything_else(gate):
    gen, probe, steer = _directions(1)
    d = probe.shape[1]
    hook = GatedSteer(probe, steer, torch.tensor([4.0, 6.0, 8.0]), gate=gate)
    hidden = torch.randn(2, 5, d, generator=gen) * 3
    assert hook._fast is None
    first = hook(None, None, hidden)  # the checked call builds the closure
    assert hook._fast is not None
    for h in (hidden, hidden[:, -1:].contiguous(), torch.randn(1, 1, d, generator=gen)):
        assert torch.equal(hook(None, None, h), hook.steer_hidden(h)[0])
    assert torch.equal(hook(None, None, hidden), first)
    # transformers 4 blocks return (hidden, cache, ...): the same closure, the rest kept
    steered, extra = hook(None, None, (hidden, "cache"))
    assert torch.equal(steered, first) and extra == "cache" and hook._fast is not None
    from_tuple = GatedSteer(probe, steer, torch.tensor([4.0, 6.0, 8.0]), gate=gate)
    from_tuple(None, None, (hidden, None))
    assert from_tuple._fast is not None and torch.equal(from_tuple(None, None, (hidden,))[0], first)
    # another dtype: the checked path
    low = hook(None, None, hidden.bfloat16())
    assert low.dtype == torch.bfloat16 and torch.equal(low, hook.steer_hidden(hidden.bfloat16())[0])
    # a wrong width fails inside torch and reaches the checked path's clear error
    with pytest.raises(GSSError, match="hidden size 8"):
        hook(None, None, torch.randn(2, 1, 8))
    assert hook._fast is None  # dropped, not rebuilt: the checked path runs from now on
    assert torch.equal(hook(None, None, hidden), first)
    # another device: the checked path moves the tensors there (meta stands in for a GPU)
    fresh = GatedSteer(probe, steer, torch.tensor([4.0, 6.0, 8.0]), gate=gate)
    fresh(None, None, hidden)
    on_meta = fresh(None, None, hidden.to("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == hidden.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_path_in_half_precision_is_exact_and_refuses_another_dtype(dtype):
    gen, probe, steer = _directions(3)
    hook = GatedSteer(probe, steer, torch.tensor([4.0, 6.0, 8.0]))
    hidden = (torch.randn(2, 5, 16, generator=gen) * 3).to(dtype)
    first = hook(None, None, hidden)
    assert hook._fast is not None and first.dtype == dtype
    for h in (hidden, hidden[:, -1:].contiguous()):
        out = hook(None, None, h)
        assert out.dtype == dtype and torch.equal(out, hook.steer_hidden(h)[0])
    assert torch.equal(hook(None, None, hidden), first)
    # another dtype would be cast back to the wrong one: refused, handed to the checked path
    other = hidden.float()
    out = hook(None, None, other)
    assert out.dtype == torch.float32 and torch.equal(out, hook.steer_hidden(other)[0])
    assert hook._fast is None


def test_turning_gate_tracking_on_leaves_the_fast_path():
    gen, probe, steer = _directions(2, k=2, d=8)
    hook = GatedSteer(probe, steer, torch.tensor([0.5, 0.5]))
    hidden = torch.randn(4, 3, 8, generator=gen)
    before = hook(None, None, hidden)
    hook.track_gates = True
    assert hook._fast is None
    assert torch.equal(hook(None, None, hidden), before)
    assert hook.gate_stats()["tokens"] == 12


def test_output_hidden_states_report_the_steered_block():
    model, art = calibrated_llama(layers=3)  # block 1 is not the last: that one's is normed
    ids = random_ids(2, 6, seed=5)
    with torch.no_grad():
        # transformers 5 puts its output-capturing hooks on the blocks at the first such call,
        # ahead of any steer attached later: the steer must still come first
        before = model(ids, output_hidden_states=True).hidden_states
        with art.attach(model):
            during = model(ids, output_hidden_states=True).hidden_states
    expected, _ = art.make_hook().steer_hidden(before[2])  # block 1's output, steered
    assert not torch.equal(expected, before[2])
    torch.testing.assert_close(during[2], expected, atol=1e-5, rtol=1e-5)


def test_the_wrapped_forward_keeps_a_forward_already_there_and_survives_a_deep_copy():
    """A steer wraps the block's ``forward`` (``SteeredForward``): around an instance forward
    already there (accelerate's), restored on removal; bound to the copy's block in a deep
    copy; a pass-through once something else wrapped on top of it."""
    model, art = calibrated_llama()
    block = gss.find_decoder_blocks(model)[1]
    ids = random_ids(2, 6, seed=5)
    with torch.no_grad():
        unsteered = model(ids).logits
        with art.attach(model):
            expected = model(ids).logits
        inner = block.forward
        calls = []

        def dispatched(*args, **kwargs):  # what accelerate's dispatch puts on a block
            calls.append(1)
            return inner(*args, **kwargs)

        block.forward = dispatched
        with art.attach(model):
            torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=1e-4)
            assert calls  # the steer ran around the forward that was there
            copied = copy.deepcopy(model)
        assert block.forward is dispatched  # restored, not dropped
        del block.forward
        copied_block = gss.find_decoder_blocks(copied)[1]
        assert copied_block.forward.block is copied_block  # bound to the copy's own block
        torch.testing.assert_close(copied(ids).logits, expected, atol=1e-4, rtol=1e-4)

        handle = art.attach(model)
        ours = block.forward
        block.forward = lambda *args, **kwargs: ours(*args, **kwargs)  # wrapped over ours
        handle.remove()  # cannot unwind what is on top: ours steers nothing from now on
        torch.testing.assert_close(model(ids).logits, unsteered, atol=0, rtol=0)
        del block.forward


def test_a_steered_model_pickles_after_a_forward():
    """torch.save of a model inside gss.steer (or a process that spawns with it): the fused
    steers cached per device are closures, left out of the pickle and built again."""
    import io

    model, art = calibrated_llama()
    ids = random_ids(2, 8, seed=5)
    with gss.steer(model, art):
        steered = model(ids).logits  # builds the fused steer
        buffer = io.BytesIO()
        torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # the steer travels with the model
    assert torch.equal(loaded(ids).logits, steered)
