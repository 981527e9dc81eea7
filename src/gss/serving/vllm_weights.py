"""Where vLLM keeps the block weights that gss's model fingerprint samples, so the vLLM plugin
can compare them with an artifact's (`gss.artifact.fingerprint.block_weights`).

vLLM stores a block's weights otherwise than transformers: fused (Llama-like models'
``self_attn.qkv_proj`` is q, k and v projections stacked by rows, ``mlp.gate_up_proj`` gate
and up) or transposed (GPT-2's Conv1D weights, kept (in, out) by transformers, are (out, in)
in vLLM). `layout` says, for the architectures whose vLLM layers were read (vLLM 0.32's
``llama.py``, ``mistral.py``, ``qwen2.py``, ``qwen3.py``, ``gemma*.py``, ``gpt2.py``), where
each transformers tensor lies in vLLM's layer; `read_layer` reads vLLM's entries at the places
transformers' sample read. A tensor it cannot place for sure (another architecture, a name it
does not know, a tensor sharded by tensor parallelism, quantized, repacked, or wrapped by a
LoRA layer) is left out, never guessed: the fingerprint compares the rest.

Imports neither vLLM nor transformers: tested on module trees built to vLLM's shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gss.artifact.fingerprint import weight_sample_index
from gss.hf.quantization import is_quantized_weight

# model types whose vLLM decoder layer keeps the names below (read in vLLM's model code)
_LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"})
_GPT2 = frozenset({"gpt2"})
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Slot:
    """Where one transformers block tensor (of shape ``hf_shape``) lies in vLLM's layer: in
    its parameter ``name``, of full (unsharded) ``shape``, from row ``offset`` on (the parts
    fused before it), transposed where transformers stores it (in, out) (HF's Conv1D)."""

    name: str
    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    offset: int = 0
    transposed: bool = False

    def index(self, hf_index: int) -> int:
        """The flat index in vLLM's tensor of the entry at flat ``hf_index`` of transformers'
        (row ``hf_index // in``, column ``hf_index % in`` of an (out, in) weight)."""
        if len(self.hf_shape) == 1:
            return self.offset + hf_index
        row, col = divmod(hf_index, self.hf_shape[1])
        if self.transposed:
            row, col = col, row
        return (self.offset + row) * self.shape[1] + col


def layout(config: Any) -> dict[str, Slot]:
    """Each block tensor's `Slot` in vLLM's decoder layer, keyed by its name in transformers'
    block (``self_attn.k_proj.weight``), the sizes from the model's (text) ``config``; empty
    for an architecture not mapped (nothing is compared there)."""
    text = getattr(config, "get_text_config", lambda: config)()
    kind = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    try:
        if kind in _LLAMA_LIKE:
            return _llama_like(text)
        if kind in _GPT2:
            return _gpt2(text)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):  # a config lacking sizes
        return {}
    return {}


def _llama_like(config: Any) -> dict[str, Slot]:
    """vLLM's ``LlamaDecoderLayer`` and its kin: ``qkv_proj`` = cat(q, k, v), ``gate_up_proj``
    = cat(gate, up), both along rows (``stacked_params_mapping``); the rest as in transformers."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(config.intermediate_size)
    slots: dict[str, Slot] = {}
    qkv = [("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)]
    _fuse(slots, "self_attn.{}_proj", "self_attn.qkv_proj", qkv, hidden)
    _fuse(slots, "mlp.{}_proj", "mlp.gate_up_proj", [("gate", inter), ("up", inter)], hidden)
    for name, rows, cols in (
        ("self_attn.o_proj", hidden, heads * head_dim),
        ("mlp.down_proj", hidden, inter),
    ):
        slots[f"{name}.weight"] = Slot(f"{name}.weight", (rows, cols), (rows, cols))
        slots[f"{name}.bias"] = Slot(f"{name}.bias", (rows,), (rows,))
    for norm, size in (
        ("input_layernorm", hidden),
        ("post_attention_layernorm", hidden),
        ("pre_feedforward_layernorm", hidden),  # Gemma 2 and 3
        ("post_feedforward_layernorm", hidden),
        ("self_attn.q_norm", head_dim),  # Qwen3, Gemma 3
        ("self_attn.k_norm", head_dim),
    ):
        slots[f"{norm}.weight"] = Slot(f"{norm}.weight", (size,), (size,))
    return slots


def _fuse(
    slots: dict[str, Slot], part: str, fused: str, sizes: list[tuple[str, int]], cols: int
) -> None:
    """The slots of the parts ``sizes`` ({name: rows}, in vLLM's order) of the ``fused``
    projection, weight and bias."""
    total, offset = sum(rows for _, rows in sizes), 0
    for key, rows in sizes:
        name = part.format(key)
        slots[f"{name}.weight"] = Slot(f"{fused}.weight", (total, cols), (rows, cols), offset)
        slots[f"{name}.bias"] = Slot(f"{fused}.bias", (total,), (rows,), offset)
        offset += rows


def _gpt2(config: Any) -> dict[str, Slot]:
    """vLLM's ``GPT2Block``: transformers' names, its Conv1D weights transposed at loading
    (``GPT2Model._transpose_conv1d``): (in, out) there, (out, in) in vLLM."""
    hidden = int(config.hidden_size)
    inter = int(getattr(config, "n_inner", None) or 4 * hidden)
    slots: dict[str, Slot] = {}
    for name, fan_in, fan_out in (
        ("attn.c_attn", hidden, 3 * hidden),
        ("attn.c_proj", hidden, hidden),
        ("mlp.c_fc", hidden, inter),
        ("mlp.c_proj", inter, hidden),
    ):
        weight = f"{name}.weight"
        slots[weight] = Slot(weight, (fan_out, fan_in), (fan_in, fan_out), transposed=True)
        slots[f"{name}.bias"] = Slot(f"{name}.bias", (fan_out,), (fan_out,))
    for norm in ("ln_1", "ln_2"):
        for kind in ("weight", "bias"):
            slots[f"{norm}.{kind}"] = Slot(f"{norm}.{kind}", (hidden,), (hidden,))
    return slots


RECORD = "_gss_block_weights"
"""The attribute of a vLLM decoder layer holding `read_layer`'s sample taken at loading."""


def record(layers: Iterable[nn.Module], config: Any) -> None:
    """Sample vLLM's decoder ``layers`` now, as loaded (`read_layer`), and keep each layer's
    sample on it: vLLM's CPU build then repacks every unquantized linear weight for oneDNN and
    leaves an empty tensor in its place (``dispatch_cpu_unquantized_gemm``), where it could no
    longer be read."""
    slots = layout(config)
    for layer in layers if slots else ():
        setattr(layer, RECORD, read_layer(layer, slots))


def vllm_block_weights(layers: Iterable[nn.Module], config: Any) -> list[dict[str, list[float]]]:
    """The ``block_weights`` of a fingerprint as vLLM's decoder ``layers`` hold them (see
    `gss.artifact.fingerprint.block_weights`): each layer's tensors read now, and those that
    are no longer readable as `record` read them at loading (but not those a LoRA layer wraps
    since, whose delta comes per request). Empty for an architecture not mapped."""
    slots = layout(config)
    out: list[dict[str, list[float]]] = []
    for layer in layers if slots else ():
        sample = read_layer(layer, slots)
        for name, values in (getattr(layer, RECORD, None) or {}).items():
            if name not in sample and name in slots and _owner_plain(layer, slots[name]):
                sample[name] = values
        out.append(sample)
    return out


def read_layer(layer: nn.Module, slots: dict[str, Slot]) -> dict[str, list[float]]:
    """vLLM's ``layer``'s entries at the places `block_weights` sampled each transformers
    tensor, in float32: ``{transformers name: values}``. A tensor is read only where it is a
    plain float tensor of its full shape (not sharded, quantized, repacked or on the meta
    device) of an unquantized layer not wrapped by a LoRA layer."""
    params = dict(layer.named_parameters())
    out: dict[str, list[float]] = {}
    for hf_name, slot in slots.items():
        weight = params.get(slot.name)
        if weight is None or not _plain(weight, slot) or not _owner_plain(layer, slot):
            continue
        hf_index = weight_sample_index(math.prod(slot.hf_shape)).tolist()
        index = torch.tensor([slot.index(i) for i in hf_index], device=weight.device)
        values = weight.detach().reshape(-1)[index]
        out[hf_name] = [float(v) for v in values.float().cpu().tolist()]
    return out


def _plain(weight: Tensor, slot: Slot) -> bool:
    """Whether ``weight`` holds the slot's values as they are: its full shape (a shard under
    tensor parallelism has fewer rows or columns; a repacked weight none), a float dtype, in
    memory."""
    if tuple(weight.shape) != slot.shape or weight.dtype not in _FLOATS:
        return False
    return weight.device.type != "meta" and not is_quantized_weight(weight)


def _owner_plain(layer: nn.Module, slot: Slot) -> bool:
    """Whether the module owning the slot's parameter computes with it as it is: it does not
    quantize it (vLLM's ``quant_method``, other than the unquantized one) and is not a LoRA
    layer of vLLM's (``base_layer``), which adds each request's adapter to it."""
    path = slot.name.rpartition(".")[0]
    try:
        owner = layer.get_submodule(path) if path else layer
    except AttributeError:
        return False
    method = getattr(owner, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
        return False
    return not hasattr(owner, "base_layer")
