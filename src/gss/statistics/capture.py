"""Reading one decoder block's output during a forward pass, and running models for it.

Calibration and the layer scan wrap a block's ``forward`` the way a steer is attached (so
compiled code sees the tap), record its output, optionally as a leaf that gradients stop at,
and optionally end the forward pass right there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import torch
from torch import Tensor, nn

from gss.data import Batch
from gss.errors import GSSError
from gss.hf.forward import forward_logits
from gss.steering.attach import SteeredForward, split_block_output
from gss.steering.compiled import refuse_if_compiled


class StopForward(Exception):
    """Raised by the tap to end a forward pass once layer L has run."""


class Tap:
    """Applied to block L's output: records it, optionally as a leaf for gradients, and
    optionally stops the forward pass right there."""

    def __init__(self, stop: bool, leaf: bool) -> None:
        self.stop = stop
        self.leaf = leaf
        self.hidden: Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden, rebuild = split_block_output(output)
        if self.leaf:
            hidden = hidden.detach().requires_grad_(True)
        self.hidden = hidden
        if self.stop:
            raise StopForward
        return rebuild(hidden) if self.leaf else None


@contextmanager
def tapped(block: nn.Module, stop: bool, leaf: bool) -> Iterator[Tap]:
    tap = Tap(stop=stop, leaf=leaf)
    handle = SteeredForward(block, tap)  # as a steer is attached: compiled code sees it
    try:
        yield tap
    finally:
        handle.remove()


@contextmanager
def calibration_mode(*models: nn.Module) -> Iterator[None]:
    """Eval mode and frozen weights for the duration; both restored afterwards. Models whose
    compiled code would not run calibration's read of a block are refused first."""
    for m in models:
        refuse_if_compiled(m, reading=True)
    states = [(m, m.training, [(p, p.requires_grad) for p in m.parameters()]) for m in models]
    try:
        for m in models:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        yield
    finally:
        for m, training, params in states:
            m.train(training)
            for p, flag in params:
                p.requires_grad_(flag)


def layer_activations(model: nn.Module, block: nn.Module, batch: Batch) -> Tensor:
    """Output of ``block`` for ``batch``, running the model only up to that block."""
    with torch.no_grad(), tapped(block, stop=True, leaf=False) as tap, suppress(StopForward):
        forward_logits(model, batch.input_ids, batch.attention_mask)
    if tap.hidden is None:
        raise GSSError("the hooked block never ran: is it part of this model's forward pass?")
    return tap.hidden


def outputs(taps: Sequence[Tap], whose: str = "") -> list[Tensor]:
    """What each tapped block output; an error if one never ran."""
    hiddens = [tap.hidden for tap in taps if tap.hidden is not None]
    if len(hiddens) != len(taps):
        raise GSSError(f"a tapped block{whose} never ran: is it part of the forward pass?")
    return hiddens


def block_outputs(model: nn.Module, blocks: Sequence[nn.Module], batch: Batch) -> list[Tensor]:
    """Outputs of ``blocks`` (in forward order) for ``batch``, running the model only up to
    the last of them."""
    if len(blocks) == 1:
        return [layer_activations(model, blocks[0], batch)]
    with torch.no_grad(), ExitStack() as stack, suppress(StopForward):
        taps = [
            stack.enter_context(tapped(b, stop=i == len(blocks) - 1, leaf=False))
            for i, b in enumerate(blocks)
        ]
        forward_logits(model, batch.input_ids, batch.attention_mask)
    return outputs(taps)
