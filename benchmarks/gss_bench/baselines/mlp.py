"""Where the MLP neurons of a decoder block live, for the methods that edit only MLPs.

TinyMem's localization methods edit only MLP parameters. A *neuron* is one output of the MLP's
input projection (after the activation), i.e. one input of its output projection. GPT-2 stores
its projections as ``Conv1D`` with weights ``(in, out)``; most other models use ``nn.Linear``
with ``(out, in)``; gated MLPs (Llama) have a gate projection beside the up projection.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from gss.errors import GSSError
from gss.hf.blocks import find_decoder_blocks

_UP = ("c_fc", "up_proj", "dense_h_to_4h", "fc1", "fc_in", "w1")
_GATE = ("gate_proj",)
_DOWN = ("c_proj", "down_proj", "dense_4h_to_h", "fc2", "fc_out", "w2")


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


# nn.Module.__getattr__ types parameters as `Tensor | Module`: these say what a projection holds
def weight_of(proj: nn.Module) -> Tensor:
    """``proj.weight``."""
    return cast(Tensor, proj.weight)


def bias_of(proj: nn.Module) -> Tensor | None:
    """``proj.bias`` (None when the projection has no bias)."""
    return cast("Tensor | None", proj.bias)


@dataclass(frozen=True)
class MLP:
    """The projections of one block's MLP."""

    layer: int
    up: nn.Module
    down: nn.Module
    gate: nn.Module | None = None

    @property
    def width(self) -> int:
        """Number of neurons."""
        return int(weight_of(self.down).shape[0 if is_conv1d(self.down) else 1])

    def neuron_inputs(self) -> list[tuple[Tensor, int]]:
        """``(tensor, dim)`` pairs whose slice ``i`` along ``dim`` feeds neuron ``i``."""
        out: list[tuple[Tensor, int]] = []
        for proj in (self.up, self.gate):
            if proj is None:
                continue
            out.append((weight_of(proj), 1 if is_conv1d(proj) else 0))
            if getattr(proj, "bias", None) is not None:
                out.append((cast(Tensor, proj.bias), 0))
        return out

    def neuron_outputs(self) -> tuple[Tensor, int]:
        """``(weight, dim)``: slice ``i`` along ``dim`` is neuron ``i``'s output vector."""
        return weight_of(self.down), 0 if is_conv1d(self.down) else 1

    def output_norms(self) -> Tensor:
        """L2 norm of each neuron's output vector (float32)."""
        weight, dim = self.neuron_outputs()
        return weight.detach().float().norm(dim=1 - dim)

    def weight_tensors(self) -> dict[str, Tensor]:
        """The MLP's parameters by short name (what weight-level methods may edit)."""
        out: dict[str, Tensor] = {}
        for label, proj in (("up", self.up), ("gate", self.gate), ("down", self.down)):
            if proj is None:
                continue
            out[f"{label}.weight"] = weight_of(proj)
            if getattr(proj, "bias", None) is not None:
                out[f"{label}.bias"] = cast(Tensor, proj.bias)
        return out


def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module) and hasattr(child, "weight"):
            return child
    return None


def mlp_layers(model: nn.Module) -> list[MLP]:
    """The MLP of every decoder block, first block first."""
    out = []
    for i, block in enumerate(find_decoder_blocks(model)):
        holder = getattr(block, "mlp", None) or getattr(block, "feed_forward", None) or block
        up, down = _child(holder, _UP), _child(holder, _DOWN)
        if up is None or down is None:
            raise GSSError(
                f"could not find the MLP projections of block {i} ({type(block).__name__}); "
                f"known input projections {_UP}, output projections {_DOWN}. Neuron and "
                "weight-level baselines support GPT-2, Llama-style, GPT-NeoX and OPT blocks."
            )
        out.append(MLP(i, up, down, _child(holder, _GATE)))
    return out


@torch.no_grad()
def zero_neurons(mlp: MLP, neurons: Tensor) -> None:
    """Ablate `neurons`: zero their input weights and biases (with ReLU, the output is 0;
    with any activation, their output weights are zeroed too so they contribute nothing)."""
    if neurons.numel() == 0:
        return
    for tensor, dim in mlp.neuron_inputs():
        tensor.index_fill_(dim, neurons.to(tensor.device), 0.0)
    weight, dim = mlp.neuron_outputs()
    weight.index_fill_(dim, neurons.to(weight.device), 0.0)


@contextmanager
def neuron_activations(mlp: MLP, store: list[Tensor]) -> Iterator[None]:
    """Append the neuron activations (input of the output projection) of each forward."""

    def hook(module: nn.Module, args: tuple) -> None:
        store.append(args[0])

    handle = mlp.down.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def scaled_neurons(mlp: MLP, scale: Tensor) -> Iterator[None]:
    """Multiply the neuron activations by `scale` (broadcast over the last dim) in forwards."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (args[0] * scale.to(args[0].dtype), *args[1:])

    handle = mlp.down.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
