"""torch.compile: a steer runs in compiled code, attached before compiling or after.

With ``torch._dynamo.config.skip_nnmodule_hook_guards`` on (torch's default), compiled code
ignores forward hooks added after compiling without them: measured here first, as the reason
gss wraps the block's forward instead, which dynamo guards on. The "eager" backend traces with
dynamo (where changes are seen or not) without generating code, so these tests need no C++
compiler.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch._dynamo
import transformers

import gss
from gss_bench.baselines.steering import MeanDifferenceSteer

from ..helpers import random_ids

IDS = random_ids(3, 10, seed=5)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _reference(make_model):
    return make_model("llama", seed=7)


def _setup(make_model):
    model = make_model("llama")
    art = gss.calibrate(
        model, _reference(make_model), random_ids(12, 16), layer=0, rank=2, progress=False
    )
    art = art.with_options(gate="none")  # every token steered: steered != plain everywhere
    return model, art


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _eager(model, art):
    plain = _logits(model)
    with gss.steer(model, art):
        steered = _logits(model)
    assert not torch.allclose(plain, steered, atol=1e-4)
    return plain, steered


def _which(logits, plain, steered):
    if torch.allclose(logits, plain, atol=1e-5):
        return "plain"
    return "steered" if torch.allclose(logits, steered, atol=1e-5) else "other"


def test_compiled_code_ignores_late_hooks_by_default(make_model):
    """The torch behaviour gss steers around: a forward hook attached after compiling never
    runs."""
    model, art = _setup(make_model)
    plain, steered = _eager(model, art)
    compiled = torch.compile(model, backend="eager")
    assert _which(_logits(compiled), plain, steered) == "plain"
    _, block = gss.hf.blocks.resolve_layer(model, 0)
    handle = block.register_forward_hook(art.make_hook())
    assert _which(_logits(compiled), plain, steered) == "plain"  # silently unsteered
    handle.remove()


def _compile(model, block, how):
    """Compile ``model`` one of the ways a user does; returns what to call."""
    if how == "wrapper":
        return torch.compile(model, backend="eager")
    if how == "method":
        model.compile(backend="eager")
    elif how == "forward":
        model.forward = torch.compile(model.forward, backend="eager")
    else:
        block.compile(backend="eager")
    return model


@pytest.mark.heavy
@pytest.mark.parametrize("how", ["wrapper", "method", "forward", "block"])
def test_a_steer_attached_after_compiling_runs_and_comes_off(make_model, how):
    """gss wraps the block's forward, which dynamo guards on: attaching to a compiled model
    recompiles with the steer, removing it goes back to the code without (both cached)."""
    model, art = _setup(make_model)
    plain, steered = _eager(model, art)
    _, block = gss.hf.blocks.resolve_layer(model, 0)
    target = _compile(model, block, how)
    seen = [_which(_logits(target), plain, steered)]
    for _ in range(2):
        with gss.steer(target, art):
            seen.append(_which(_logits(target), plain, steered))
        seen.append(_which(_logits(target), plain, steered))
    assert seen == ["plain", "steered", "plain", "steered", "plain"]
    # a baseline's steering hook is attached the same way
    with MeanDifferenceSteer(torch.ones(32), alpha=1.0).attach(target, 0):
        assert _which(_logits(target), plain, steered) == "other"
    assert _which(_logits(target), plain, steered) == "plain"
    assert not block._forward_hooks and "forward" not in vars(block)  # nothing left attached
    # calibrating the compiled model reads the same activations as the eager one
    again = gss.calibrate(
        target, _reference(make_model), random_ids(12, 16), layer=0, rank=2, progress=False
    )
    assert torch.allclose(again.steer, art.steer, atol=1e-5)


def test_attaching_again_finds_the_code_compiled_with_the_steer(make_model):
    """Dynamo guards on the wrapper's identity. Every attach after the first puts the block's
    last wrapper back, so steering some calls and not others compiles each state once, not
    once per attach (before: one more compile each time, and torch's limit of 8 then left
    the model running uncompiled); another steer of the same shapes runs in the same code,
    its own tensors flowing in."""
    model, art = _setup(make_model)
    other = dataclasses.replace(art, offset=art.offset + 1.0)
    plain, steered = _eager(model, art)
    with gss.steer(model, other):
        other_steered = _logits(model)
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    compiled = torch.compile(model, backend=counting)
    counts = []
    for _ in range(3):
        torch.testing.assert_close(_logits(compiled), plain, atol=1e-5, rtol=1e-5)
        with gss.steer(model, art):
            torch.testing.assert_close(_logits(compiled), steered, atol=1e-5, rtol=1e-5)
        with gss.steer(model, other):
            torch.testing.assert_close(_logits(compiled), other_steered, atol=1e-5, rtol=1e-5)
        counts.append(len(compiles))
    assert counts[0] == counts[-1] <= 3, counts


def test_without_inlined_modules_a_compiled_model_is_refused(make_model, monkeypatch):
    """Before torch 2.5 dynamo does not inline modules by default, and then compiled code did
    not see late hooks (torch 2.4.1); the wrapped forward is not trusted there either. Newer
    torch always inlines, so the old setting is simulated."""
    monkeypatch.setattr(gss.steering.compiled, "_modules_inlined", lambda: False)
    model, art = _setup(make_model)
    _, block = gss.hf.blocks.resolve_layer(model, 0)
    target = _compile(model, block, "method")
    with pytest.raises(gss.GSSError, match="inline_inbuilt_nn_modules = True"):
        art.attach(target)
    with pytest.raises(gss.GSSError, match="inline_inbuilt_nn_modules"):
        MeanDifferenceSteer(torch.ones(32), alpha=1.0).attach(target, 0)
    assert "forward" not in vars(block)  # nothing was left attached
    with pytest.raises(gss.GSSError, match="Calibrate before compiling"):
        gss.calibrate(
            target, make_model("llama", seed=7), random_ids(4, 8), layer=0, progress=False
        )
    fresh = make_model("llama")
    art.attach(fresh).remove()  # an uncompiled model is steered as ever


def test_a_steer_attached_before_compiling_runs_and_comes_off(make_model):
    """A steer present when compiling is guarded: removing it recompiles, and attaching it
    anew is seen again."""
    model, art = _setup(make_model)
    plain, steered = _eager(model, art)
    handle = art.attach(model)
    model.compile(backend="eager")
    assert _which(_logits(model), plain, steered) == "steered"
    handle.remove()
    assert _which(_logits(model), plain, steered) == "plain"
    with art.attach(model):
        assert _which(_logits(model), plain, steered) == "steered"
    assert _which(_logits(model), plain, steered) == "plain"


@pytest.mark.parametrize("gate", ["hard", "none"])
def test_the_steer_compiles_into_the_models_graph_without_a_break(make_model, gate):
    """The steer adds no graph break: a compiled model stays one graph (CUDA graphs, fusion)
    with it attached, on its first call (the checked path) and after (the fused closure)."""
    model, art = _setup(make_model)
    with art.attach(model, gate=gate), torch.no_grad():
        for _ in range(2):
            explained = torch._dynamo.explain(model)(input_ids=IDS)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
                str(r.reason) for r in explained.break_reasons
            ]


def test_a_wrapper_the_model_does_not_know_of_still_follows_the_steer(make_model):
    """``torch.compile(model)`` returns a wrapper that ``model`` holds no reference to; a steer
    attached to the model itself is still seen through it (dynamo guards on the block)."""
    model, art = _setup(make_model)
    plain, steered = _eager(model, art)
    compiled = torch.compile(model, backend="eager")
    _logits(compiled)
    assert gss.steering.compiled.compiled_parts(model) == []  # gss cannot see it, and need not
    with art.attach(model):
        assert _which(_logits(compiled), plain, steered) == "steered"
    assert _which(_logits(compiled), plain, steered) == "plain"


def test_generate_compiling_its_decode_steps_follows_the_steer(make_model):
    """``generate`` compiles the decode steps for a static cache (on GPUs by default): a
    forward hook attached afterwards steers the uncompiled prefill and silently not one decode
    step; a steer attached by gss steers every step, and comes off."""
    compile_config = getattr(transformers, "CompileConfig", None)
    if compile_config is None:
        pytest.skip("transformers before 4.47 does not compile in generate")
    model, art = _setup(make_model)
    ids = random_ids(1, 6, seed=2)
    config = compile_config(backend="eager", mode=None)
    config._compile_all_devices = True  # transformers' switch to compile on a CPU, for tests

    def generate(**options):
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                cache_implementation="static",
                **options,
            )

    plain = generate(compile_config=config)
    assert "compiled by generate" in " ".join(gss.steering.compiled.compiled_parts(model))
    _, block = gss.hf.blocks.resolve_layer(model, 0)
    bypass = block.register_forward_hook(art.make_hook())
    late = generate(compile_config=config)
    eager = generate(disable_compile=True)
    bypass.remove()
    assert late[0, 6] == eager[0, 6]  # the prefill's token: steered
    assert not torch.equal(late, eager)  # the decode steps: not
    with art.attach(model):
        assert torch.equal(generate(compile_config=config), eager)
    assert torch.equal(generate(compile_config=config), plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_generate_with_cuda_graphs_follows_the_steer(make_model, dtype):
    """On a GPU ``generate`` compiles its decode steps by default for a static cache, with
    inductor and CUDA graphs: a steer attached to that model is recorded into new graphs and
    taken out again. Compared through the first compiled step's scores, which inductor may
    round differently from eager but not by as much as the steer moves them."""
    compile_config = getattr(transformers, "CompileConfig", None)
    if compile_config is None:
        pytest.skip("transformers before 4.47 does not compile in generate")
    model, art = _setup(make_model)
    model.to("cuda", dtype)
    art = art.with_options(delta=25.0)  # far more than inductor's rounding
    ids = random_ids(2, 6, seed=2).to("cuda")

    def scores(**options):
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=4,
                do_sample=False,
                cache_implementation="static",
                output_scores=True,
                return_dict_in_generate=True,
                **options,
            )
        return out.sequences, out.scores[1].float()  # step 0 is the prefill, uncompiled

    plain_ids, plain = scores(disable_compile=True)
    with art.attach(model):
        steered_ids, steered = scores(disable_compile=True)
    apart = (plain - steered).abs().max()
    seen = []
    for attached in (False, True, False, True, False):
        with art.attach(model) if attached else contextlib.nullcontext():
            got_ids, got = scores(compile_config=compile_config())
        near_steered = (got - steered).abs().max() < apart / 10
        near_plain = (got - plain).abs().max() < apart / 10
        seen.append("steered" if near_steered else "plain" if near_plain else "other")
        # the prefill (eager) picked the same token, so the compiled step saw the same prefix
        assert torch.equal(got_ids[:, :7], (steered_ids if attached else plain_ids)[:, :7])
    assert seen == ["plain", "steered", "plain", "steered", "plain"]
    assert "compiled by generate" in " ".join(gss.steering.compiled.compiled_parts(model))
