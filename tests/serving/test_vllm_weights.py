"""The fingerprint's block weights under vLLM, without vLLM (`gss.serving.vllm_weights`,
`vllm_plugin._check_artifact`): a tiny transformers model, and module trees built to vLLM's
shapes from its weights (Llama-like: ``qkv_proj`` = cat(q, k, v) and ``gate_up_proj`` =
cat(gate, up) by rows; GPT-2: its Conv1D weights transposed). The same weights read back as
transformers' sample, in half precision too; another fine-tune's is refused, naming the
block; a tensor vLLM holds otherwise (a tensor-parallel shard, quantized, repacked by its CPU
build, behind a LoRA layer) is left out, not misread. tests/vllm runs it inside vLLM."""

from __future__ import annotations

import copy
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gss.artifact.fingerprint import block_weights, fingerprint_differences, model_fingerprint
from gss.errors import GSSError
from gss.serving import vllm_plugin, vllm_weights

from ..helpers import HAS_QWEN3, tiny_model

LLAMA_LIKE = ["llama", "mistral", "qwen2", *(["qwen3"] if HAS_QWEN3 else [])]
FUSED = {  # vLLM's fused projection: transformers' parts, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
CONV1D = ("c_attn", "c_proj", "c_fc")  # GPT-2's weights stored (in, out) by transformers


def _put(root: nn.Module, name: str, value: Tensor) -> None:
    """``value`` as the parameter ``name`` (dotted) of ``root``, making the modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]  # type: ignore[assignment]
    module.register_parameter(leaf, nn.Parameter(value.detach().clone(), requires_grad=False))


def vllm_shaped(model: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A module tree holding ``model``'s block weights as vLLM's does, in ``dtype``: Llama-like
    layers at ``model.layers`` with fused projections (and ``model.embed_tokens``), GPT-2's
    at ``transformer.h`` with its Conv1D weights transposed."""
    root, layers = nn.Module(), nn.ModuleList()
    gpt2 = model.config.model_type == "gpt2"
    blocks = model.transformer.h if gpt2 else model.model.layers
    for block in blocks:
        weights = {n: p.detach().to(dtype) for n, p in block.named_parameters()}
        layer = nn.Module()
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                if f"{parts[0]}.{kind}" in weights:
                    stacked = [weights.pop(f"{part}.{kind}") for part in parts]
                    _put(layer, f"{fused}.{kind}", torch.cat(stacked))
        for name, value in weights.items():
            conv1d = gpt2 and name.endswith(".weight") and any(c in name for c in CONV1D)
            _put(layer, name, value.t().contiguous() if conv1d else value)
        layers.append(layer)
    if gpt2:
        _put(root, "transformer.wte.weight", model.transformer.wte.weight.to(dtype))
        root.transformer.h = layers
    else:
        _put(root, "model.embed_tokens.weight", model.model.embed_tokens.weight.to(dtype))
        root.model.layers = layers
    return root


def artifact_of(model: Any) -> Any:
    """What `_check_artifact` reads of an artifact calibrated on ``model``."""
    return SimpleNamespace(provenance=SimpleNamespace(fingerprint=model_fingerprint(model)))


def fine_tuned(model: Any, name: str, block: int = 1, seed: int = 0) -> Any:
    """A copy of ``model`` whose tensor ``name`` of ``block`` moved (noise over all of it), as
    another fine-tune of the same base (its embeddings left as they were)."""
    other = copy.deepcopy(model)
    blocks = other.transformer.h if other.config.model_type == "gpt2" else other.model.layers
    weight = blocks[block].get_parameter(name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=gen) * (float(weight.std()) or 0.02))
    return other


def layers_of(vllm_model: nn.Module) -> nn.ModuleList:
    return vllm_plugin._decoder_layers(vllm_model, 2)


@pytest.mark.parametrize("arch", [*LLAMA_LIKE, "gpt2"])
def test_every_tensor_of_the_block_has_its_place_in_vllm(arch: str) -> None:
    model = tiny_model(arch)
    sampled = block_weights(model)[0]
    assert set(sampled) <= set(vllm_weights.layout(model.config))
    assert len(sampled) >= 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch", [*LLAMA_LIKE, "gpt2"])
def test_vllm_layers_read_back_the_transformers_sample(arch: str, dtype: torch.dtype) -> None:
    """vLLM's fused (or transposed) copy of the same weights reads, at every tensor, the
    entries transformers' fingerprint sampled: equal in float32, within rounding in half
    precision; the artifact is accepted."""
    model = tiny_model(arch)
    served = vllm_shaped(model, dtype)
    got = vllm_weights.vllm_block_weights(layers_of(served), model.config)
    expected = block_weights(model)
    assert [set(g) for g in got] == [set(e) for e in expected]
    if dtype == torch.float32:
        assert got == expected
    else:
        assert got != expected  # rounded, and still the same model
    assert fingerprint_differences({"block_weights": expected}, {"block_weights": got}) == []
    vllm_plugin._check_artifact(artifact_of(model), served, model.config)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_vllm_layers_are_read_under_vllm_s_default_dtype(dtype: torch.dtype) -> None:
    """vLLM loads a model, and so the plugin samples it, under the model's dtype as torch's
    default: the places sampled are still transformers' (a bfloat16 ``linspace`` rounded them,
    past the end of the tensor: the engine failed to start, CI of 2026-12-05)."""
    model = tiny_model("llama")
    served = vllm_shaped(model, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        vllm_weights.record(layers_of(served), model.config)
        got = vllm_weights.vllm_block_weights(layers_of(served), model.config)
    finally:
        torch.set_default_dtype(previous)
    expected = block_weights(model)
    assert [set(g) for g in got] == [set(e) for e in expected]
    assert fingerprint_differences({"block_weights": expected}, {"block_weights": got}) == []


@pytest.mark.parametrize(
    ("arch", "tensor"),
    [
        ("llama", "self_attn.k_proj.weight"),
        ("llama", "mlp.up_proj.weight"),
        ("llama", "mlp.down_proj.weight"),
        ("qwen2", "self_attn.v_proj.bias"),
        ("gpt2", "attn.c_attn.weight"),
        ("gpt2", "mlp.c_proj.weight"),
    ],
)
def test_another_fine_tune_is_refused(arch: str, tensor: str) -> None:
    """The artifact of a model, served by vLLM on another fine-tune of its base (one tensor of
    block 1 changed, embeddings as they were), is refused with the block and tensor named."""
    model = tiny_model(arch)
    other = fine_tuned(model, tensor)
    served = vllm_shaped(other, torch.bfloat16)
    with pytest.raises(GSSError, match="than the one vLLM serves") as refused:
        vllm_plugin._check_artifact(artifact_of(model), served, model.config)
    assert "decoder block(s) [1]" in str(refused.value) and tensor in str(refused.value)
    assert "embeddings" not in str(refused.value)


def _shard(layer: nn.Module) -> None:
    """Tensor parallelism's first shard of 2: half the rows of the fused projections, half
    the columns of the row-parallel ones."""
    for name in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
        _put(layer, name, layer.get_parameter(name)[: layer.get_parameter(name).shape[0] // 2])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        _put(layer, name, layer.get_parameter(name)[:, : layer.get_parameter(name).shape[1] // 2])


def _quantize(layer: nn.Module) -> None:
    for name in (
        *(f"{f}.weight" for f in FUSED),
        "self_attn.o_proj.weight",
        "mlp.down_proj.weight",
    ):
        weight = layer.get_parameter(name)
        _put(layer, name, (weight * 127 / weight.abs().max()).to(torch.int8))


def _repack(layer: nn.Module) -> None:
    """What vLLM's CPU build leaves of a linear weight once repacked for oneDNN."""
    for name in (
        *(f"{f}.weight" for f in FUSED),
        "self_attn.o_proj.weight",
        "mlp.down_proj.weight",
    ):
        _put(layer, name, torch.empty(0))


def _to_meta(layer: nn.Module) -> None:
    for name in (
        *(f"{f}.weight" for f in FUSED),
        "self_attn.o_proj.weight",
        "mlp.down_proj.weight",
    ):
        _put(layer, name, torch.empty(layer.get_parameter(name).shape, device="meta"))


class LoRALayer(nn.Module):
    """vLLM's LoRA layer: the projection as ``base_layer``, a delta per request added to it."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base
        self.weight = base.weight  # vLLM's LoRA layers expose the base's weight


def _wrap_in_lora(layer: nn.Module) -> None:
    for owner in (*FUSED, "self_attn.o_proj", "mlp.down_proj"):
        parent, _, leaf = owner.rpartition(".")
        module = layer.get_submodule(parent)
        module.add_module(leaf, LoRALayer(module.get_submodule(leaf)))


UNREADABLE = {
    "sharded": _shard,
    "quantized": _quantize,
    "repacked": _repack,
    "meta": _to_meta,
    "lora": _wrap_in_lora,
}


@pytest.mark.parametrize("how", list(UNREADABLE))
def test_a_tensor_vllm_holds_otherwise_is_left_out(how: str) -> None:
    """A projection vLLM holds sharded, quantized, repacked, on the meta device or behind a
    LoRA layer is left out of the comparison, not misread: another fine-tune that changed
    only such tensors (k and down projections) is not refused, the same model is accepted,
    and the tensors still read (the norms) are compared."""
    model = tiny_model("llama")
    other = fine_tuned(fine_tuned(model, "self_attn.k_proj.weight"), "mlp.down_proj.weight")
    served = vllm_shaped(other)
    for layer in layers_of(served):
        UNREADABLE[how](layer)
    got = vllm_weights.vllm_block_weights(layers_of(served), model.config)
    assert [set(g) for g in got] == [
        {"input_layernorm.weight", "post_attention_layernorm.weight"}
    ] * 2
    vllm_plugin._check_artifact(artifact_of(model), served, model.config)
    norm = fine_tuned(other, "post_attention_layernorm.weight", block=0)
    served = vllm_shaped(norm)
    for layer in layers_of(served):
        UNREADABLE[how](layer)
    with pytest.raises(GSSError, match=r"decoder block\(s\) \[0\]"):
        vllm_plugin._check_artifact(artifact_of(model), served, model.config)


def test_with_no_block_tensor_readable_shapes_and_embeddings_are_compared() -> None:
    """No tensor of any block read (an architecture not mapped, or all left out): the check
    is what it was, shapes and embeddings, and does not fail on the blocks."""
    model = tiny_model("llama")
    other = fine_tuned(model, "mlp.down_proj.weight")
    served = vllm_shaped(other)
    for layer in layers_of(served):
        for name, _ in list(layer.named_parameters()):
            _put(layer, name, torch.empty(0))
    assert vllm_weights.vllm_block_weights(layers_of(served), model.config) == [{}, {}]
    vllm_plugin._check_artifact(artifact_of(model), served, model.config)
    unmapped = SimpleNamespace(**{**model.config.to_dict(), "model_type": "phi"})
    assert vllm_weights.layout(unmapped) == {}
    served = vllm_shaped(other)
    served.model.embed_tokens.weight.data.mul_(2.0)
    with pytest.raises(GSSError, match="input embeddings differ"):
        vllm_plugin._check_artifact(artifact_of(model), served, model.config)


def test_weights_sampled_at_loading_outlive_the_cpu_repacking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's CPU build repacks every linear weight after loading (``process_weights_after_
    loading``) and leaves an empty tensor: the plugin samples them just before, while a
    runner serving artifacts loads, so another fine-tune is still refused; a projection that a
    LoRA layer wraps since (its delta comes per request) is left out. Without artifacts
    nothing is sampled."""
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    model = tiny_model("llama")
    other = fine_tuned(model, "mlp.down_proj.weight")
    served = vllm_shaped(other)

    def process_weights_after_loading(model: nn.Module, model_config: Any, device: Any) -> None:
        for layer in layers_of(model):
            _repack(layer)

    loader = ModuleType(vllm_plugin._LOADER_MODULE)
    loader.process_weights_after_loading = process_weights_after_loading  # type: ignore[attr-defined]
    vllm_plugin._patch_module(loader)
    model_config = SimpleNamespace(hf_config=model.config)
    plain = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={}))
    with vllm_plugin._record_weights_of(plain):
        loader.process_weights_after_loading(served, model_config, "cpu")
    assert not hasattr(layers_of(served)[0], vllm_weights.RECORD)

    served = vllm_shaped(other)
    extra = {"gss_artifacts": {"tiny": "artifact"}}
    steering = SimpleNamespace(vllm_config=SimpleNamespace(additional_config=extra))
    with vllm_plugin._record_weights_of(steering):
        loader.process_weights_after_loading(served, model_config, "cpu")
    assert not vllm_plugin._recording
    assert layers_of(served)[0].get_parameter("mlp.down_proj.weight").numel() == 0  # repacked
    with pytest.raises(GSSError, match=r"decoder block\(s\) \[1\].*mlp.down_proj.weight"):
        vllm_plugin._check_artifact(artifact_of(model), served, model.config)
    for layer in layers_of(served):
        _wrap_in_lora(layer)
    got = vllm_weights.vllm_block_weights(layers_of(served), model.config)
    assert "mlp.down_proj.weight" not in got[1] and "input_layernorm.weight" in got[1]
    vllm_plugin._check_artifact(artifact_of(model), served, model.config)


def test_slot_index_follows_the_fused_and_transposed_layouts() -> None:
    """Entry (row r, column c) of a transformers (out, in) weight: row offset + r of vLLM's
    fused tensor; of a Conv1D (in, out) weight: row c, column r of vLLM's."""
    k = vllm_weights.Slot("qkv.weight", shape=(10, 3), hf_shape=(2, 3), offset=6)
    assert k.index(0) == 18 and k.index(5) == 23  # rows 6 and 7
    conv = vllm_weights.Slot("c_fc.weight", shape=(4, 2), hf_shape=(2, 4), transposed=True)
    assert conv.index(1) == 2 and conv.index(4) == 1  # (0, 1) -> (1, 0); (1, 0) -> (0, 1)
    bias = vllm_weights.Slot("qkv.bias", shape=(10,), hf_shape=(2,), offset=6)
    assert bias.index(1) == 7
