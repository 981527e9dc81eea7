"""Which model an artifact was calibrated for: its fingerprint (shape, a sample of the input
embedding, a few entries of every weight tensor of every block and of every other weight: the
final norm, an untied output head, position embeddings) and what differs between two
fingerprints.

Attaching a steer compares the model's fingerprint with the one saved in the artifact and
refuses another model (`SteeringArtifact.check_model`); another fine-tune of the same base
differs in its blocks' weights, the same weights in another dtype, quantized, or behind
unmerged LoRA adapters do not.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from gss.hf.blocks import find_decoder_blocks, residual_width
from gss.hf.forward import input_embedding_values, vocab_size
from gss.hf.quantization import is_quantized_weight

if TYPE_CHECKING:
    from typing_extensions import Buffer

_SAMPLE = 8  # embedding sample: _SAMPLE x _SAMPLE entries


def embedding_sample(emb: Tensor) -> list[float]:
    """An evenly spaced _SAMPLE x _SAMPLE grid of the input embedding matrix ``emb`` (vocab x
    hidden), in float32 rounded to 6 decimals: what `fingerprint_differences` compares within a
    tolerance. The vLLM plugin reads it from vLLM's copy of the embedding."""
    rows = spaced_index(emb.shape[0], _SAMPLE).to(emb.device)
    cols = spaced_index(emb.shape[1], _SAMPLE).to(emb.device)
    sample = emb[rows][:, cols].float().cpu()
    return [round(v, 6) for v in sample.flatten().tolist()]


def model_fingerprint(model: nn.Module, block_path: str | None = None) -> dict[str, Any]:
    """Identify a model by shape and by a sample of its input embedding.

    The sample is compared with a tolerance, so the same weights in float32, bfloat16 or
    float16 match, while another model does not.
    """
    emb = input_embedding_values(model).detach()
    hash_rows = spaced_index(emb.shape[0], min(256, emb.shape[0])).to(emb.device)
    sampled = emb[hash_rows].to(torch.bfloat16).view(torch.int16).cpu().numpy()
    # numpy's stubs declare the buffer protocol of arrays only for Python >= 3.12
    digest = hashlib.sha256(cast("Buffer", sampled))
    config = getattr(model, "config", None)
    return {
        "architecture": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "hidden_size": residual_width(model),
        "num_layers": len(find_decoder_blocks(model, block_path)),
        "vocab_size": vocab_size(model),
        "embedding_sample": embedding_sample(emb),
        "embedding_hash": digest.hexdigest()[:16],
        "blocks_sample": blocks_sample(model, block_path),
        "block_weights": block_weights(model, block_path),
        "head_weights": head_weights(model, block_path),
    }


_WEIGHT_SAMPLE = 8  # entries read from every weight tensor of every block
# two weights are the same up to rounding where they differ by at most this share of their
# size (bfloat16 rounds to 2^-8 of it, float16 to 2^-11) plus float16's smallest step
_ROUNDING, _TINY = 2.0**-7, 1e-7


def block_weights(model: nn.Module, block_path: str | None = None) -> list[dict[str, list[float]]]:
    """A few entries of every weight tensor of every decoder block, in float32: a fine-tune
    that changes any of them (an MLP-only or attention-output-only one too) changes some, while
    the same weights in bfloat16 or float16 stay within rounding of them
    (`fingerprint_differences`). A tensor not in memory (meta) or stored quantized is left out;
    under an unmerged PEFT adapter the weight is read as the block computes it (base + delta)."""
    out: list[dict[str, list[float]]] = []
    for block in find_decoder_blocks(model, block_path):
        entry: dict[str, list[float]] = {}
        for name, weight, adapters in _block_weights(block):
            if weight.device.type == "meta" or is_quantized_weight(weight) or not weight.numel():
                continue
            index = weight_sample_index(weight.numel()).to(weight.device)
            plain = weight.detach().reshape(-1)[index]
            values = plain if adapters is None else _plus_adapters(adapters, weight, index, plain)
            if values is not None:
                entry[name] = [float(v) for v in values.float().cpu().tolist()]
        out.append(entry)
    return out


def head_weights(model: nn.Module, block_path: str | None = None) -> dict[str, list[float]]:
    """A few entries of every weight outside the decoder blocks and the input embedding (the
    final norm, an output head not tied to the embedding, position embeddings), by name as the
    plain model names them (a PEFT wrapper's prefix and ``base_layer`` left out): a fine-tune
    that changed only the head reads as the model it is. Tensors not in memory, quantized or
    of an adapter (``lora_*``) are left out, as in `block_weights`."""
    inside = {id(p) for block in find_decoder_blocks(model, block_path) for p in block.parameters()}
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = getattr(get_emb(), "weight", None) if callable(get_emb) else None
    out: dict[str, list[float]] = {}
    for name, weight in model.named_parameters():  # a tied head is the embedding: listed once
        if id(weight) in inside or weight is emb or "lora_" in name or not weight.numel():
            continue
        if weight.device.type == "meta" or is_quantized_weight(weight):
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        index = weight_sample_index(weight.numel()).to(weight.device)
        out[key] = [float(v) for v in weight.detach().reshape(-1)[index].float().cpu().tolist()]
    return out


def weight_sample_index(numel: int) -> Tensor:
    """The flat indices `block_weights` reads from a tensor of ``numel`` entries: evenly spaced,
    so a reader of the same weights stored otherwise (vLLM's fused projections,
    `gss.serving.vllm_weights`) finds the same entries."""
    return spaced_index(numel, min(_WEIGHT_SAMPLE, numel))


def spaced_index(size: int, count: int) -> Tensor:
    """``count`` evenly spaced indices into ``size`` entries, the same wherever they are taken:
    computed in float32 whatever torch's default dtype (vLLM loads a model under a bfloat16
    default, where ``linspace`` rounds 196607 up to 196608), as every saved fingerprint was,
    and kept below ``size`` (float32 rounds past the end above 2^24 entries)."""
    index = torch.linspace(0, size - 1, count, dtype=torch.float32).long()
    return index.clamp_(max=max(size - 1, 0))


def _changed_tensors(ours: dict[str, list[float]], theirs: dict[str, list[float]]) -> list[str]:
    """The tensors sampled in both whose entries differ beyond rounding: two or more of them
    (any, for a tensor of fewer than four entries)."""
    changed = []
    for name, values in ours.items():
        other = theirs.get(name)
        if other is None or len(other) != len(values) or not values:
            continue
        a, b = torch.tensor(values, dtype=torch.float64), torch.tensor(other, dtype=torch.float64)
        beyond = int(((a - b).abs() > a.abs() * _ROUNDING + _TINY).sum())
        if beyond >= min(2, len(values)):  # NaN compares as no difference: said elsewhere
            changed.append(name)
    return changed


_BLOCK_SAMPLE = 16  # weights read from each of a block's first two weight tensors


def blocks_sample(model: nn.Module, block_path: str | None = None) -> list[dict[str, Any]]:
    """A few weights of every decoder block, as bfloat16 bit patterns: a fine-tune of the same
    base changes some block (its embeddings may stay as they were), while the same weights in
    float32, bfloat16 or float16 round to the same bfloat16 values. Blocks whose weights are
    not in memory (offloaded to the meta device) or are stored quantized (their values are the
    model's, rounded further) record nothing, so a steer calibrated on the full weights
    attaches to the same model quantized, and back."""
    out: list[dict[str, Any]] = []
    for block in find_decoder_blocks(model, block_path):
        named = [w for w in _block_weights(block) if w[1].numel() >= _BLOCK_SAMPLE][:2]
        entry: dict[str, Any] = {"names": [n for n, _, _ in named], "bits": []}
        for _, weight, adapters in named:
            if weight.device.type == "meta" or is_quantized_weight(weight):
                entry = {"names": [], "bits": []}
                break
            index = spaced_index(weight.numel(), _BLOCK_SAMPLE).to(weight.device)
            plain = weight.detach().reshape(-1)[index]
            values = plain if adapters is None else _plus_adapters(adapters, weight, index, plain)
            if values is None:
                entry = {"names": [], "bits": []}
                break
            bits = values.to(torch.bfloat16).view(torch.int16).cpu().tolist()
            entry["bits"].extend(int(b) for b in bits)
        out.append(entry)
    return out


def _block_weights(block: nn.Module) -> list[tuple[str, Tensor, Any]]:
    """A block's parameters under the names of the merged model, each with the PEFT adapter
    layer (LoRA, ...) that wraps it, or None: inside such a layer its base layer's,
    ``q_proj.base_layer.weight`` read as ``q_proj.weight``, and not the adapter's own; so a
    fine-tune with adapters and the same fine-tune merged sample the same tensors."""
    tuners = {name: m for name, m in block.named_modules() if _adapter_layer(m)}
    out: list[tuple[str, Tensor, Any]] = []
    for name, weight in block.named_parameters():
        owner = next((t for t in tuners if name.startswith(f"{t}.")), None)
        if owner is None:
            out.append((name, weight, None))
        elif name.startswith(f"{owner}.base_layer."):
            layer = tuners[owner]
            wrapped = layer if getattr(layer.base_layer, "weight", None) is weight else None
            out.append((f"{owner}.{name[len(owner) + len('.base_layer.') :]}", weight, wrapped))
    return out


def _adapter_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (it wraps the model's own layer as ``base_layer``)."""
    return hasattr(module, "base_layer") and hasattr(module, "active_adapters")


@torch.no_grad()
def _plus_adapters(layer: Any, weight: Tensor, index: Tensor, values: Tensor) -> Tensor | None:
    """`values` (`weight` at the flat `index`) as the block computes them: plus the delta
    of each active, unmerged adapter of its PEFT `layer` (switched off: as they are). A
    fine-tune with a LoRA then samples as its merged model does, and as its base model does
    not. A plain LoRA's delta ``scale * B @ A`` is read at the sampled entries alone (B's rows
    dotted with A's columns): the whole product would cost a matrix of the weight's size per
    block at every attach. None where an active adapter is not merged by adding a delta (IA3
    scales activations, DoRA rescales the sum): nothing to compare."""
    if getattr(layer, "disable_adapters", False):
        return values
    merged = set(getattr(layer, "merged_adapters", ()))
    names = getattr(layer, "adapter_layer_names", ())  # e.g. ("lora_A", "lora_B", ...)
    own = getattr(layer, names[0], {}) if names else {}
    active: list[str] = list(getattr(layer, "active_adapters", ()))
    for adapter in active:
        if adapter in merged or adapter not in own:
            continue  # merged already, or not an adapter of this layer
        variant = adapter in getattr(layer, "lora_variant", {})  # newer peft
        if variant or getattr(layer, "use_dora", {}).get(adapter, False):  # older peft: DoRA
            return None  # merged otherwise than by adding a delta (DoRA, ...)
        a, b = _lora_weight(layer, "lora_A", adapter), _lora_weight(layer, "lora_B", adapter)
        if weight.dim() == 2 and a is not None and b is not None and a.dim() == b.dim() == 2:
            rows, cols = index // weight.shape[1], index % weight.shape[1]
            if getattr(layer, "fan_in_fan_out", False):  # weight stored (in, out)
                rows, cols = cols, rows
            delta = (b.float()[rows] * a.float()[:, cols].T).sum(-1) * layer.scaling[adapter]
        elif callable(getattr(layer, "get_delta_weight", None)):
            delta = layer.get_delta_weight(adapter).reshape(-1)[index]
        else:
            return None  # no delta to add (IA3, ...)
        values = values + delta.to(values.dtype)
    return values


def _lora_weight(layer: Any, name: str, adapter: str) -> Tensor | None:
    """The weight of `layer`'s LoRA matrix `name` (``lora_A``/``lora_B``) for `adapter`."""
    modules = getattr(layer, name, None)
    if modules is None or adapter not in modules:
        return None
    weight = getattr(modules[adapter], "weight", None)
    return weight if isinstance(weight, Tensor) else None


def config_fingerprint(config: Any) -> dict[str, Any]:
    """The shape fields of a fingerprint as a model's config gives them (a server that has the
    config, not the module: `gss serve`, vLLM); `fingerprint_differences` compares them."""
    text = getattr(config, "get_text_config", lambda: config)()
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": getattr(text, "hidden_size", None),
        "num_layers": getattr(text, "num_hidden_layers", None),
        "vocab_size": getattr(text, "vocab_size", None),
    }


def fingerprint_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable list of what differs between two fingerprints (empty if they match)."""
    diffs = []
    for key in ("model_type", "hidden_size", "num_layers", "vocab_size"):
        if expected.get(key) != actual.get(key):
            diffs.append(f"{key}: artifact {expected.get(key)!r}, model {actual.get(key)!r}")
    a = torch.tensor(expected.get("embedding_sample", []))
    b = torch.tensor(actual.get("embedding_sample", []))
    if a.shape == b.shape and a.numel():
        rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
        if rel > 2e-2:
            diffs.append(f"input embeddings differ (relative difference {rel:.3f} on a sample)")
    head = _changed_tensors(expected.get("head_weights") or {}, actual.get("head_weights") or {})
    if head:  # compared where both sampled them (an artifact saved before, vLLM: not)
        diffs.append(
            f"the weights outside the decoder blocks ({', '.join(head[:3])}) differ from the "
            "model the artifact was calibrated on, beyond float16/bfloat16 rounding"
        )
    if expected.get("block_weights") and actual.get("block_weights"):
        per_block = [
            (i, _changed_tensors(ours, theirs))
            for i, (ours, theirs) in enumerate(
                zip(expected["block_weights"], actual["block_weights"], strict=False)
            )
        ]
        blocks = [(i, names) for i, names in per_block if names]
        if blocks:
            first = ", ".join(blocks[0][1][:3])
            diffs.append(
                f"the weights of decoder block(s) {[i for i, _ in blocks]} differ from the model "
                f"the artifact was calibrated on, beyond float16/bfloat16 rounding (block "
                f"{blocks[0][0]}: {first}), as another fine-tune of the same base would"
            )
        return diffs
    changed = []  # an artifact saved before every tensor was sampled: its first two
    for i, (ours, theirs) in enumerate(
        zip(expected.get("blocks_sample", []), actual.get("blocks_sample", []), strict=False)
    ):
        # compared where both read the same tensors (not across an adapter wrapper)
        if ours.get("names") != theirs.get("names") or not ours.get("bits"):
            continue
        pairs = list(zip(ours["bits"], theirs.get("bits", []), strict=False))
        equal = sum(a == b for a, b in pairs) / max(len(pairs), 1)
        if equal < 0.9:
            changed.append(i)
    if changed:
        diffs.append(
            f"the weights of decoder block(s) {changed} differ from the model the artifact was "
            "calibrated on (a sample of each), as another fine-tune of the same base would"
        )
    return diffs
