"""Calibrate, attach, generate and remove on every supported architecture."""

import pytest
import torch

import gss

from .helpers import ARCHITECTURES, random_ids


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_calibrate_attach_generate_remove(make_model, arch):
    model, ref = make_model(arch, seed=0, layers=3), make_model(arch, seed=1, layers=3)
    art = gss.calibrate(model, ref, random_ids(10, 12), layer=-2, rank=3, progress=False)
    assert art.layer == 1 and art.rank == 3
    assert art.provenance.fingerprint["model_type"] == model.config.model_type
    prompt = random_ids(2, 6, seed=4)
    with torch.no_grad():
        base_logits = model(input_ids=prompt).logits
    handle = art.attach(model, gate="none")
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
        )
        steered_logits = model(input_ids=prompt).logits
    handle.remove()
    assert out.shape == (2, 10)
    assert not torch.allclose(steered_logits, base_logits)
    with torch.no_grad():
        assert torch.equal(model(input_ids=prompt).logits, base_logits)
