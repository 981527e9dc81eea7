"""The fingerprint sees every weight tensor of every block (issue 69): an artifact refuses a
fine-tune that changed only its MLP, or only its attention output, and attaches to the same
weights in float16 or bfloat16."""

from __future__ import annotations

import copy

import pytest
import torch

import gss
from gss import GSSError, GSSWarning

from ..helpers import random_ids, tiny_model


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_model("llama", seed=3, layers=3)
    reference = tiny_model("llama", seed=11, layers=3)
    art = gss.calibrate(
        model, reference, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False
    )
    return model, art


def _tuned(model, name: str, block: int = 2, scale: float = 0.03):
    """A fine-tune that moved one weight tensor of one block by ~3% of its size."""
    other = copy.deepcopy(model)
    weight = dict(other.model.layers[block].named_parameters())[name]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=gen) * weight.abs().mean() * scale)
    return other


@pytest.mark.parametrize(
    "name",
    [
        "mlp.down_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.v_proj.weight",
        "mlp.up_proj.weight",
    ],
)
def test_a_fine_tune_of_any_one_tensor_is_refused(calibrated, name):
    model, art = calibrated
    with pytest.raises(GSSError, match=r"decoder block\(s\) \[2\] differ .*" + name):
        art.check_model(_tuned(model, name))


@pytest.mark.parametrize("name", ["lm_head.weight", "model.norm.weight"])
def test_a_fine_tune_of_the_head_or_the_final_norm_is_refused(calibrated, name):
    """Weights outside the blocks count too: a fine-tune of the output head alone, or of the
    final norm, is another model; the same weights in bfloat16 are not."""
    model, art = calibrated
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied: its own
    other = copy.deepcopy(model)
    weight = dict(other.named_parameters())[name]
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    with pytest.raises(GSSError, match=r"weights outside the decoder blocks \(" + name):
        art.check_model(other)
    art.check_model(copy.deepcopy(model).to(torch.bfloat16))  # no error


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_same_weights_in_half_precision_are_accepted(calibrated, dtype):
    model, art = calibrated
    art.check_model(copy.deepcopy(model).to(dtype))  # no error


def test_an_artifact_saved_before_every_tensor_was_sampled_still_compares(calibrated):
    """An older artifact's fingerprint has the first two tensors of each block only: it still
    refuses what those show, and says that it cannot see the rest (an MLP-only fine-tune)."""
    import dataclasses
    import warnings

    model, art = calibrated
    old = dict(art.provenance.fingerprint)
    old.pop("block_weights")
    older = dataclasses.replace(
        art, provenance=dataclasses.replace(art.provenance, fingerprint=old)
    )
    with pytest.warns(GSSWarning, match="no entries of its blocks' weights"):
        older.check_model(model)
    with pytest.raises(GSSError, match="another model"), pytest.warns(GSSWarning):
        older.check_model(_tuned(model, "self_attn.q_proj.weight", scale=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        art.check_model(model)  # a full fingerprint: no warning


@pytest.mark.parametrize("default", [torch.float64, torch.float16, torch.bfloat16])
def test_the_places_sampled_do_not_depend_on_torch_s_default_dtype(default):
    """Under any default dtype (vLLM loads under the model's) the indices are float32's, as
    every saved fingerprint's were, and stay inside the tensor, past 2^24 entries too."""
    from gss.artifact.fingerprint import spaced_index

    sizes = [(196608, 8), (4096, 16), (50257, 256), (2**25 + 4, 8)]
    expected = [torch.linspace(0, n - 1, k, dtype=torch.float32).long() for n, k in sizes]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = [spaced_index(n, k) for n, k in sizes]
    finally:
        torch.set_default_dtype(previous)
    for (n, _), g, e in zip(sizes, got, expected, strict=True):
        assert g.max() < n
        assert torch.equal(g[:-1], e[:-1])
    assert int(expected[-1][-1]) == 2**25 + 4 and int(got[-1][-1]) == 2**25 + 3
