"""Which positions open some gate of a steer, read teacher-forced: for measurement scripts
that ask where the gates open on a memorized window (not what the steer then does)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gss.artifact.stack import SteeringStack
from gss.hf.blocks import resolve_layer
from gss.steering.attach import split_block_output


@contextmanager
def reading_gates(model: Any, steer: Any) -> Iterator[list[torch.Tensor]]:
    """While open, each forward of ``model`` (one row) appends, per member of ``steer`` at its
    block, a (T,) bool tensor: where some gate of it opens on the unsteered hidden state. The
    list is the caller's to clear between rows; the hooks come off on exit."""
    members = list(steer) if isinstance(steer, SteeringStack) else [steer]
    seen: list[torch.Tensor] = []

    def reader(hook: Any) -> Any:
        def read(module: Any, args: Any, output: Any) -> None:
            hidden = split_block_output(output)[0]
            seen.append(hook.correction(hidden.detach())[1].reshape(hidden.shape[1], -1).any(-1))

        return read

    handles = [
        resolve_layer(model, m.layer, m.config.block_path)[1].register_forward_hook(
            reader(m.make_hook())
        )
        for m in members
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
