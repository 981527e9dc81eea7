"""Replay, rather than recompute, the decoder blocks below a steered block.

`gss.protect` measures a hundred or so steers on the same rows, and a steer at block L leaves
blocks 0..L-1 computing exactly what they computed for every other steer at L or above. Within
`BlockPrefixReplay.below(L)`, the output of block L-1 is recorded for each input batch the
model sees (keyed by the batch's contents), and when the same batch comes again the blocks
below L return that output instead of running: block L receives the tensor it would have
computed. The first replay at each L is checked: the blocks run once more and their output
must equal the recording bit for bit (the same inputs through the same weights, on a
deterministic backend); otherwise replay is switched off for this model and everything runs
as before, as it does for a model holding torch.compile code. Recordings stay on the model's
device, within ``max_bytes``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from gss.hf.blocks import find_decoder_blocks
from gss.hf.forward import accepts
from gss.steering.attach import SteeredForward
from gss.steering.compiled import compiled_parts

_MiB = 1 << 20


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def _copy(output: Any) -> Any:
    """A copy that later in-place changes to the returned output cannot reach."""
    if isinstance(output, Tensor):
        return output.detach().clone()
    if isinstance(output, tuple):
        return tuple(_copy(item) for item in output)
    if isinstance(output, list):
        return [_copy(item) for item in output]
    return output


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is None and b is None


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes | None:
    """A digest of a model call's inputs: its tensors' contents, shapes and dtypes, and its
    other arguments' reprs. None when an argument is neither (no replay for that call)."""
    digest = hashlib.blake2b(digest_size=20)
    items = [(str(i), a) for i, a in enumerate(args)] + sorted(kwargs.items())
    for name, value in items:
        digest.update(name.encode())
        if isinstance(value, Tensor):
            data = value.detach().contiguous().cpu()
            digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        elif value is None or isinstance(value, (bool, int, float, str)):
            digest.update(repr(value).encode())
        else:
            return None
    return digest.digest()


class _Below(SteeredForward):
    """One block's ``forward`` while replay at ``layer`` is on: the recorded output of block
    ``layer - 1`` when its batch was recorded (and replay at ``layer`` was checked), else the
    block's own output, recorded at block ``layer - 1``. Put on and taken off as a steer's
    wrapper is (`SteeredForward`), with no hook of its own."""

    def __init__(self, replay: BlockPrefixReplay, block: nn.Module, index: int, layer: int):
        self.replay, self.index, self.layer = replay, index, layer
        super().__init__(block)  # a pass-through: no hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replay, layer = self.replay, self.layer
        store = replay._store.get(layer)
        key = replay._current
        recorded = None if store is None or key is None else store.get(key)
        if recorded is not None and layer in replay._checked:
            # one copy a call, made at block 0 and passed on by the blocks up to layer - 1:
            # whatever the model does with it between blocks cannot reach the recording
            if self.index == 0:
                replay._replaying = _copy(recorded)
                replay.replayed += 1
            return replay._replaying
        output = self.forward(*args, **kwargs)  # type: ignore[misc]  # None only once removed
        if self.index == layer - 1 and key is not None and store is not None:
            if recorded is not None:  # the first replay at this layer: same bits, or no replay
                if _same(output, recorded):
                    replay._checked.add(layer)
                else:
                    replay._switch_off()
            else:
                replay._record(layer, key, output)
        return output


class BlockPrefixReplay:
    """Records and replays the output of the blocks below a steered block (module docstring).
    ``max_bytes``: the most the recordings may hold, all layers together; the layer used
    longest ago is dropped first."""

    def __init__(self, model: nn.Module, max_bytes: int = 512 * _MiB) -> None:
        self.model = model
        self.blocks = find_decoder_blocks(model)
        self.max_bytes = max_bytes
        self._takes_cache = accepts(model, "use_cache")
        self._store: OrderedDict[int, dict[bytes, Any]] = OrderedDict()
        self._sizes: dict[int, int] = {}
        self._checked: set[int] = set()
        self._current: bytes | None = None
        self._replaying: Any = None
        # compiled code guards on each block's forward: a wrapper put on per point would
        # recompile the model for every point, where replay is meant to save time
        self.off = bool(compiled_parts(model))
        self.replayed = 0  # calls answered from a recording (for tests and reports)

    @contextmanager
    def below(self, layer: int) -> Iterator[None]:
        """Within: model calls replay blocks 0..layer-1 where their batch was recorded."""
        if self.off or not 0 < layer <= len(self.blocks):
            yield
            return
        self._store.setdefault(layer, {})
        self._sizes.setdefault(layer, 0)
        self._store.move_to_end(layer)
        wrappers = [_Below(self, self.blocks[i], i, layer) for i in range(layer)]
        pre = self.model.register_forward_pre_hook(self._read_key, with_kwargs=True)
        try:
            yield
        finally:
            pre.remove()
            for wrapper in reversed(wrappers):
                wrapper.remove()
            self._current = self._replaying = None

    def _read_key(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self._current = _key(tuple(args), dict(kwargs)) if self._replayable(kwargs) else None

    def _replayable(self, kwargs: dict[str, Any]) -> bool:
        """Only calls whose result is the last block's output alone: no KV cache filled (the
        blocks replayed would leave theirs empty) and no per-block outputs asked for."""
        config = getattr(self.model, "config", None)
        for name in ("output_hidden_states", "output_attentions"):
            if kwargs.get(name) or (kwargs.get(name) is None and getattr(config, name, False)):
                return False
        return kwargs.get("use_cache") is False or not self._takes_cache

    def _record(self, layer: int, key: bytes, output: Any) -> None:
        size = sum(t.numel() * t.element_size() for t in _tensors(output))
        while sum(self._sizes.values()) + size > self.max_bytes and len(self._store) > 1:
            oldest = next(iter(self._store))
            if oldest == layer:
                break
            del self._store[oldest]
            self._sizes.pop(oldest, None)
            self._checked.discard(oldest)
        if sum(self._sizes.values()) + size > self.max_bytes:
            return  # full: this batch runs in full every time
        self._store[layer][key] = _copy(output)
        self._sizes[layer] += size

    def _switch_off(self) -> None:
        self.off = True
        self._store.clear()
        self._sizes.clear()
        self._checked.clear()
