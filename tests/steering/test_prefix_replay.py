"""BlockPrefixReplay: a batch seen before at a layer skips the blocks below it, and the logits
are the same bits as computing them; what cannot be replayed (a KV cache filled, per-block
outputs asked for, another batch) is computed; a block that does not repeat itself switches
replay off."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gss
from gss.hf.forward import forward_logits
from gss.steering.prefix_replay import BlockPrefixReplay

from ..helpers import random_ids, tiny_model


def _counting(block: torch.nn.Module) -> list[int]:
    """Count the calls of ``block``'s own forward (an instance attribute, as accelerate puts)."""
    calls = [0]
    forward = block.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return forward(*args, **kwargs)

    block.forward = counted
    return calls


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_replayed_logits_are_the_computed_ones(arch: str) -> None:
    model = tiny_model(arch, seed=3, layers=3)
    reference = tiny_model(arch, seed=11, layers=3)
    rows = random_ids(16, 14, seed=2)
    art = gss.calibrate(model, reference, rows, layer=2, rank=2, progress=False)
    art = art.with_options(delta=25.0)
    ids = random_ids(4, 12, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as the search's batches have
    with torch.no_grad(), art.attach(model):
        expected = forward_logits(model, ids, mask)
    steers = (art, art.with_options(delta=5.0))  # two steers at the same block
    with torch.no_grad():
        wants = []
        for steer in steers:
            with steer.attach(model):
                wants.append(forward_logits(model, ids, mask))
    replay = BlockPrefixReplay(model)
    calls = _counting(replay.blocks[0])
    with torch.no_grad():
        for steer, want in zip(steers, wants, strict=True):
            for _ in range(3):
                with replay.below(2), steer.attach(model):
                    got = forward_logits(model, ids, mask)
                assert torch.equal(got, want)
        # recorded once, checked once (the blocks below ran twice), then replayed
        assert calls[0] == 2 and replay.replayed == 4 and not replay.off
        with replay.below(2), art.attach(model):
            assert torch.equal(forward_logits(model, ids, mask), expected)
            other = random_ids(4, 12, seed=6)  # a batch not seen: computed
            forward_logits(model, other, torch.ones_like(other))
    assert calls[0] == 3
    assert "forward" not in replay.blocks[1].__dict__  # the blocks are as they were


def test_what_cannot_be_replayed_is_computed() -> None:
    model = tiny_model("llama", seed=3, layers=3)
    ids = random_ids(2, 10, seed=1)
    replay = BlockPrefixReplay(model)
    calls = _counting(replay.blocks[0])
    with torch.no_grad(), replay.below(2):
        for _ in range(3):
            model(input_ids=ids, use_cache=False)
        assert calls[0] == 2  # recorded, checked, then replayed
        for kwargs in (
            {"use_cache": True},  # the replayed blocks would leave their KV cache empty
            {},  # the model's default: a cache
            {"use_cache": False, "output_hidden_states": True},  # per-block outputs
        ):
            model(input_ids=ids, **kwargs)
            assert calls[0] == 3
            calls[0] = 2
    with torch.no_grad(), replay.below(0):  # nothing below block 0
        model(input_ids=ids, use_cache=False)
    assert calls[0] == 3


def test_a_block_that_does_not_repeat_itself_switches_replay_off() -> None:
    model = tiny_model("llama", seed=3, layers=3)
    ids = random_ids(2, 10, seed=1)
    replay = BlockPrefixReplay(model)
    block = replay.blocks[1]
    forward = block.forward

    def noisy(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        noise = torch.randn_like(hidden)
        return (hidden + noise, *out[1:]) if isinstance(out, tuple) else hidden + noise

    block.forward = noisy
    with torch.no_grad(), replay.below(2):
        model(input_ids=ids, use_cache=False)
        model(input_ids=ids, use_cache=False)  # the check fails
    assert replay.off and replay.replayed == 0
    with torch.no_grad(), replay.below(2):
        model(input_ids=ids, use_cache=False)
    assert replay.replayed == 0


def test_recordings_stay_within_max_bytes() -> None:
    model = tiny_model("llama", seed=3, layers=3)
    ids = random_ids(2, 10, seed=1)
    one = 2 * 10 * 32 * 4  # a (2, 10, 32) float32 block output
    replay = BlockPrefixReplay(model, max_bytes=one)
    with torch.no_grad():
        with replay.below(1):
            model(input_ids=ids, use_cache=False)
        with replay.below(2):  # the older layer's recording makes room
            model(input_ids=ids, use_cache=False)
            model(input_ids=random_ids(2, 10, seed=2), use_cache=False)  # no room: computed
    assert list(replay._store) == [2] and len(replay._store[2]) == 1
    assert sum(replay._sizes.values()) <= one


def test_a_compiled_model_is_not_replayed() -> None:
    """Compiled code guards on the blocks' forward: wrapping them per point would recompile."""
    model = tiny_model("llama", seed=3, layers=3)
    model.compile()
    replay = BlockPrefixReplay(model)
    assert replay.off
    with replay.below(2):
        assert "forward" not in replay.blocks[0].__dict__
