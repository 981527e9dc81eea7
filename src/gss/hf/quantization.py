"""Quantized models: loading them, and whether calibration can backpropagate through them.

Two backends load a model quantized (``from_pretrained(..., quantization_config=...)``):

* optimum-quanto's weight-only quantization (``int8``, ``int4``, ``float8``), which runs on a
  CPU as on a GPU. Its layers pass gradients to their input, so calibration's backward pass
  through the blocks above the steered one works on the quantized model (measured on tiny
  Llamas: the top steer direction within |cos| >= 0.99 of the unquantized model's in int8);
* bitsandbytes (``bnb-8bit``, ``bnb-4bit``: ``--load-in-8bit`` / ``--load-in-4bit``), which
  needs a CUDA GPU; refused before anything loads elsewhere.

Any other ``transformers`` quantization config may be passed as is (the Python API). Not every
backend's layers pass gradients (torchao's int8 dynamic-activation layers return outputs with
no ``grad_fn``, measured), and a layer that silently drops its share of the gradient would
give wrong statistics, not an error: `check_backward` probes one layer of each quantized kind
before a calibration pass and refuses the model in one sentence when the gradient is missing
or wrong.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gss.errors import GSSError

__all__ = [
    "BITSANDBYTES",
    "QUANTIZATIONS",
    "QUANTO",
    "check_backward",
    "is_quantized",
    "is_quantized_weight",
    "quantization_config",
]

# optimum-quanto's weight types, by the name gss takes (`--quantization`)
QUANTO = {"int8": "int8", "int4": "int4", "float8": "float8"}
# bitsandbytes, by name (`--load-in-8bit`, `--load-in-4bit`)
BITSANDBYTES = {"bnb-8bit": "load_in_8bit", "bnb-4bit": "load_in_4bit"}
QUANTIZATIONS = (*QUANTO, *BITSANDBYTES)
QUANT_EXTRA = "pip install 'gated-subspace-steering[quant]'"
# the relative error `check_backward` allows on <grad, x> (measured: <= 1e-3 in bfloat16 for
# quanto and torchao's weight-only int8; a dropped gradient is off by 100%)
BACKWARD_TOLERANCE = 0.05


def quantization_config(quantization: Any, dtype: torch.dtype, device: torch.device | None) -> Any:
    """The ``transformers`` quantization config for ``quantization``: a name of
    `QUANTIZATIONS`, or a config object passed through (None: none). What the backend needs
    (its package, accelerate, a CUDA GPU for bitsandbytes) is checked here, before any load;
    ``device`` is where the model runs (None: a device map decides)."""
    if quantization is None:
        return None
    if not isinstance(quantization, str):
        if not hasattr(quantization, "quant_method"):
            raise GSSError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} or a transformers "
                f"quantization config (e.g. QuantoConfig, BitsAndBytesConfig), got "
                f"{type(quantization).__name__}."
            )
        return quantization
    if quantization not in QUANTIZATIONS:
        raise GSSError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}."
        )
    if importlib.util.find_spec("accelerate") is None:
        raise GSSError(f"loading a model quantized needs accelerate: {QUANT_EXTRA}.")
    if quantization in QUANTO:
        if importlib.util.find_spec("optimum") is None or (
            importlib.util.find_spec("optimum.quanto") is None
        ):
            raise GSSError(
                f"--quantization {quantization} quantizes with optimum-quanto, which is not "
                f"installed: {QUANT_EXTRA}."
            )
        from transformers import QuantoConfig

        return QuantoConfig(weights=QUANTO[quantization])
    flag = "--" + BITSANDBYTES[quantization].replace("_", "-")
    on_cpu = device is not None and device.type != "cuda"
    if on_cpu or not torch.cuda.is_available():
        raise GSSError(
            f"{flag} quantizes with bitsandbytes, which needs a CUDA GPU"
            + (f" (the model is to run on {device})" if on_cpu else " (this torch sees none)")
            + ": use --device cuda on a machine with one, or --quantization int8 (optimum-quanto"
            ", which runs on a CPU)."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise GSSError(
            f"{flag} quantizes with bitsandbytes, which is not installed: pip install bitsandbytes."
        )
    from transformers import BitsAndBytesConfig

    if quantization == "bnb-8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)


def is_quantized_weight(weight: Any) -> bool:
    """Whether ``weight`` is stored quantized: a tensor subclass (quanto's, torchao's) or an
    integer tensor (bitsandbytes' packed weights), rather than plain floats."""
    if not isinstance(weight, torch.Tensor):
        return False
    data = weight.data if isinstance(weight, nn.Parameter) else weight
    if not weight.dtype.is_floating_point:
        return True
    # a sharded DTensor (torch.distributed) holds plain floats
    kind = type(data)
    return kind is not torch.Tensor and not kind.__module__.startswith("torch.distributed")


def _quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and is_quantized_weight(weight):
            out.append((name, module))
    return out


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of ``model`` holds quantized weights."""
    return bool(_quantized_layers(model))


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype activations flow in: that of the model's unquantized floating weights."""
    for p in model.parameters():
        if p.is_floating_point() and not is_quantized_weight(p):
            return p.dtype
    return torch.float32


def _layer_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its dispatch hook's device under a device map, else that of
    its weights."""
    hooked = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hooked is not None:
        return torch.device(hooked)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _probe(module: nn.Module, dtype: torch.dtype) -> str | None:
    """What is wrong with the gradient ``module`` passes to its input, or None when it is
    right: for a layer linear in its input (any weight-only quantization), W x is
    ``f(2x) - f(x)`` (the bias cancels), and the gradient of ``<f(x), Wx>`` dotted with x
    must give ``|Wx|^2``."""
    width = getattr(module, "in_features", None)
    if not isinstance(width, int):
        return None  # not a linear layer: nothing known to check against
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, width, generator=gen).to(device=_layer_device(module), dtype=dtype)
    x.requires_grad_(True)
    try:
        with torch.enable_grad():
            y = module(x)
            if not y.requires_grad:
                return "its output does not depend on its input through autograd (no grad_fn)"
            with torch.no_grad():
                wx = (module(2 * x) - y).float()
            (grad,) = torch.autograd.grad(y, x, grad_outputs=wx.to(y.dtype), allow_unused=True)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return f"its backward fails: {(str(e).strip().splitlines() or [''])[0]}"
    if grad is None:
        return "its output does not depend on its input through autograd"
    expected = float(wx.pow(2).sum())
    got = float((grad.float() * x.detach().float()).sum())
    if not torch.isfinite(torch.tensor(got)) or abs(got - expected) > BACKWARD_TOLERANCE * abs(
        expected
    ):
        return f"the gradient it passes is wrong (<grad, x> = {got:.4g}, expected {expected:.4g})"
    return None


def check_backward(model: nn.Module, below: Iterable[nn.Module] = ()) -> None:
    """Refuse, before a calibration pass, a quantized model whose quantized layers do not
    pass the right gradient to their input: calibration backpropagates the memorized tokens'
    objective through the blocks above the steered one. The layers inside ``below`` (the
    steered block and those under it, which the backward never reaches) are not asked. One
    layer of each kind (layer class, weight class) is probed; an unquantized model costs one
    walk over its modules."""
    skipped = {id(m) for block in below for m in block.modules()}
    seen: set[tuple[type, type]] = set()
    dtype = _float_dtype(model)
    for name, module in _quantized_layers(model):
        kind = (type(module), type(module._parameters["weight"]))
        if kind in seen or id(module) in skipped:
            continue
        seen.add(kind)
        problem = _probe(module, dtype)
        if problem is not None:
            raise GSSError(
                f"calibration backpropagates through the blocks above the steered one, and this "
                f"model's quantized layers ({kind[0].__name__} with {kind[1].__name__} weights, "
                f"e.g. {name}) do not pass gradients: {problem}. Calibrate on the model loaded "
                "unquantized, or quantized with a backend whose layers pass gradients "
                "(e.g. --quantization int8: optimum-quanto), then steer this model with that "
                "artifact."
            )
