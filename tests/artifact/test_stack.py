"""Multi-block steering (gss.SteeringStack): saved, loaded, attached and removed as one, with
the same invariants as one block's steer (exact removal, cache == no cache, left padding ==
single rows)."""

from __future__ import annotations

import json

import pytest
import torch

import gss
from gss import GSSError, SteeringStack
from gss.hf.forward import cache_argument, returned_cache

from ..helpers import random_ids, tiny_model


@pytest.fixture(scope="module")
def stacked():
    model = tiny_model("llama", seed=3, layers=3)
    ref = tiny_model("llama", seed=11, layers=3)
    rows = random_ids(16, 14, seed=2)
    first = gss.calibrate(model, ref, rows, layer=0, rank=2, progress=False)
    first = first.with_options(delta=25.0)
    with first.attach(model):  # the second block sees the model steered at the first
        second = gss.calibrate(model, ref, rows, layer=2, rank=2, progress=False)
    return model, SteeringStack((first, second.with_options(delta=25.0)))


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_stack_is_its_members_attached_together(stacked):
    model, stack = stacked
    ids = random_ids(3, 10, seed=5)
    plain = _logits(model, ids)
    with gss.steer(model, stack) as handle:
        together = _logits(model, ids)
        assert handle.active and stack.layers == (0, 2)
    one, two = (a.attach(model) for a in stack)
    by_hand = _logits(model, ids)
    one.remove(), two.remove()
    assert torch.equal(together, by_hand)
    assert not torch.allclose(together, plain)  # it steers
    assert torch.equal(_logits(model, ids), plain)  # and comes off exactly


def test_stack_save_load_roundtrip(stacked, tmp_path):
    model, stack = stacked
    stack.save_pretrained(tmp_path / "s")
    loaded = gss.load(tmp_path / "s")
    assert isinstance(loaded, SteeringStack) and loaded.layers == stack.layers
    for a, b in zip(stack, loaded, strict=True):
        assert torch.equal(a.probe, b.probe) and torch.equal(a.thresholds, b.thresholds)
        assert a.config == b.config
    ids = random_ids(2, 9, seed=6)
    with gss.steer(model, stack):
        want = _logits(model, ids)
    with gss.steer(model, loaded):
        assert torch.equal(_logits(model, ids), want)
    assert "2 blocks [0, 2]" in loaded.describe()


def _decoded(model, ids, start):
    """The last-position logits of a KV-cached decode: the prompt ``ids[:, :start]`` in one
    pass, then one token a step up to the row's last."""
    cache = cache_argument(model)
    with torch.no_grad():
        out = model(input_ids=ids[:, :start], use_cache=True)
        past, steps = returned_cache(out), [out.logits[:, -1]]
        for t in range(start, ids.shape[1] - 1):
            out = model(input_ids=ids[:, t : t + 1], use_cache=True, **{cache: past})
            past = returned_cache(out)
            steps.append(out.logits[:, -1])
    return torch.stack(steps, 1)


def test_stack_cache_and_padding_invariants(stacked):
    model, stack = stacked
    ids = random_ids(1, 12, seed=7)
    with gss.steer(model, stack):
        full = _logits(model, ids)
        assert torch.allclose(_decoded(model, ids, 8), full[:, 7:11], atol=1e-5)
        short = random_ids(1, 7, seed=8)
        pad = torch.zeros(1, 5, dtype=torch.long)
        padded = torch.cat([pad, short], 1)
        mask = torch.cat([pad, torch.ones_like(short)], 1)
        batch = _logits(model, torch.cat([padded, ids]), torch.cat([mask, torch.ones_like(ids)]))
        assert torch.allclose(batch[0, 5:], _logits(model, short)[0], atol=1e-5)
        assert torch.allclose(batch[1], full[0], atol=1e-5)


def test_a_stack_of_two_models_steers_is_refused_naming_the_member(stacked):
    """Else it loads, and fails at attach on whichever model, naming no member."""
    _, stack = stacked
    other = tiny_model("llama", seed=5, layers=3)  # another model of the same shape
    ref = tiny_model("llama", seed=11, layers=3)
    theirs = gss.calibrate(other, ref, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False)
    with pytest.raises(GSSError, match=r"member 2 \(block 1\) was calibrated on another model"):
        SteeringStack((*stack.artifacts, theirs))
    SteeringStack((stack.artifacts[0], stack.artifacts[1]))  # one model's: accepted


def test_stack_refuses_what_it_cannot_do(stacked, tmp_path):
    model, stack = stacked
    with pytest.raises(GSSError, match="takes no options"):
        stack.attach(model, delta=1.0)
    with pytest.raises(GSSError, match="at least one"):
        SteeringStack(())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(GSSError, match="holds files that are not"):
        stack.save_pretrained(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    stack.save_pretrained(tmp_path / "s")
    with pytest.raises(GSSError, match="already holds"):
        stack.save_pretrained(tmp_path / "s")
    for index, message in ((2, "no member 2"), ("0", "by its index"), (True, "by its index")):
        with pytest.raises(GSSError, match=message):
            stack.with_member(index, delta=5.0)  # type: ignore[arg-type]
    stack.with_member(1, delta=5.0).save_pretrained(tmp_path / "s", overwrite=True)
    assert gss.load(tmp_path / "s").artifacts[1].config.delta == 5.0
    manifest = json.loads((tmp_path / "s" / "gss_stack.json").read_text())
    sealed = manifest["members"][0]["tensors_sha256"]
    manifest["members"][0]["tensors_sha256"] = "0" * 64
    (tmp_path / "s" / "gss_stack.json").write_text(json.dumps(manifest))
    with pytest.raises(GSSError, match="SHA-256 differs"):
        gss.load(tmp_path / "s")
    manifest["members"][0]["tensors_sha256"] = sealed
    manifest["members"] = manifest["members"][:1]  # a member taken off the list, not the disk
    (tmp_path / "s" / "gss_stack.json").write_text(json.dumps(manifest))
    with pytest.raises(GSSError, match=r"holds steer-1, which gss_stack\.json does not list"):
        gss.load(tmp_path / "s")
    (tmp_path / "s" / "gss_stack.json").write_text("{")
    with pytest.raises(GSSError, match="not valid JSON"):
        gss.load(tmp_path / "s")


def test_a_failing_member_leaves_nothing_attached(stacked, monkeypatch):
    model, stack = stacked
    second = stack.artifacts[1]
    attach = type(second).attach

    def failing(self, *args, **kwargs):
        if self is second:
            raise GSSError("this member cannot attach")
        return attach(self, *args, **kwargs)

    monkeypatch.setattr(type(second), "attach", failing)
    ids = random_ids(2, 9, seed=9)
    plain = _logits(model, ids)
    with pytest.raises(GSSError, match="this member cannot attach"):
        stack.attach(model)
    assert torch.equal(_logits(model, ids), plain)  # the first member came off again


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (benchmarks/scripts/gpu_checks.sh)"
)
def test_stack_on_cuda(stacked):
    """The stack on a GPU: its members move with the model, come off exactly, and a KV-cached
    decode gives the logits of the full forward."""
    import copy

    cpu_model, stack = stacked
    model = copy.deepcopy(cpu_model).cuda()
    ids = random_ids(2, 12, seed=9).cuda()
    plain = _logits(model, ids)
    with gss.steer(model, stack):
        full = _logits(model, ids)
        assert torch.allclose(_decoded(model, ids, 8), full[:, 7:11], atol=1e-4)
    assert not torch.allclose(full, plain)
    assert torch.equal(_logits(model, ids), plain)
    with gss.steer(cpu_model, stack):  # the same steer as on the CPU, to float32 rounding
        assert torch.allclose(_logits(cpu_model, ids.cpu()), full.cpu(), atol=1e-4)
