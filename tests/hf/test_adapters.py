"""gss.adapters_off: an adapter fine-tune's own base as the reference, without a second copy."""

import copy
import json

import pytest
import torch

import gss
from gss import GSSError
from gss.cli import main
from gss.hf.forward import forward_logits

from ..helpers import general_rows, random_ids, tiny_model, train, word_tokenizer
from ..test_sign import _planted_loss, steered_losses

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _randomise_lora(model: torch.nn.Module, seed: int = 0) -> None:
    """LoRA starts as a no-op (B = 0): give B weights so the adapter changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0)
    tuned = peft.get_peft_model(model, config)
    _randomise_lora(tuned)
    return tuned.eval()


def _logits(model, ids):
    with torch.no_grad():
        return forward_logits(model, ids, torch.ones_like(ids))


@pytest.fixture
def models():
    base = tiny_model("llama", layers=3)
    reference = copy.deepcopy(base)  # get_peft_model edits `base` in place
    return _lora(base), reference


def test_runs_the_base_and_leaves_the_adapters_on(models):
    model, reference = models
    ids = random_ids(3, 12)
    tuned = _logits(model, ids)
    assert not torch.allclose(tuned, _logits(reference, ids), atol=1e-3)  # the adapter matters
    off = gss.adapters_off(model)
    torch.testing.assert_close(_logits(off, ids), _logits(reference, ids))
    assert torch.equal(_logits(model, ids), tuned)  # switched back on after the call
    assert sum(p.numel() for p in off.parameters()) == sum(p.numel() for p in model.parameters())


def test_a_steer_on_the_model_does_not_steer_its_adapters_off_reference(models):
    """The reference shares the model's blocks: a steer attached to the model (protect's
    second block is calibrated so) must leave the base model the reference is unsteered,
    and steer the model again after each reference call."""
    model, reference = models
    ids = random_ids(8, 12, seed=3)
    artifact = gss.calibrate(model, gss.adapters_off(model), ids, layer=1, rank=2, progress=False)
    off = gss.adapters_off(model)
    base = _logits(off, ids)
    unsteered = _logits(model, ids)
    with gss.steer(model, artifact.with_options(gate="none", delta=8.0)):
        steered = _logits(model, ids)
        assert not torch.allclose(steered, unsteered, atol=1e-3)  # the steer acts
        assert torch.equal(_logits(off, ids), base)  # not on the reference
        assert torch.equal(_logits(model, ids), steered)  # and again on the model after it
    torch.testing.assert_close(base, _logits(reference, ids))


def test_decoding_through_adapters_off_passes_the_cache_under_its_own_name(models):
    """Greedy decoding with the KV cache through the reference wrapper: the cache goes under the
    name the wrapped model's forward takes (transformers >= 5.24 warns on the old one), and the
    tokens are the loaded base's."""
    import warnings

    from gss.evaluate.decoding import greedy_generate
    from gss.hf.forward import cache_argument

    model, reference = models
    off = gss.adapters_off(model)
    assert cache_argument(off) == cache_argument(reference)
    prompts = random_ids(2, 5).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        steps = greedy_generate(off, prompts, 6, pad_id=0)
    assert steps == greedy_generate(reference, prompts, 6, pad_id=0)


def test_calibration_against_adapters_off_equals_calibration_against_the_loaded_base(models):
    model, reference = models
    rows = random_ids(12, 16, seed=4)
    lora_flags = [p.requires_grad for p in model.parameters()]
    kwargs = dict(layer=1, rank=2, progress=False)
    ours = gss.calibrate(model, gss.adapters_off(model), rows, **kwargs)
    loaded = gss.calibrate(model, reference, rows, **kwargs)
    assert ours.provenance.token_counts == loaded.provenance.token_counts
    for name in ("probe", "steer", "thresholds"):
        torch.testing.assert_close(getattr(ours, name), getattr(loaded, name), rtol=1e-4, atol=1e-5)
    assert [p.requires_grad for p in model.parameters()] == lora_flags  # restored
    scan = gss.scan_layers(model, gss.adapters_off(model), rows, progress=False)
    assert set(scan.strengths) == {0, 1, 2} and not scan.unchanged


def test_transformers_adapter_integration():
    base = tiny_model("llama")
    reference = copy.deepcopy(base)
    try:
        base.add_adapter(peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    except ValueError as err:  # transformers 5.24 asks for peft >= 0.22.0 before any exists
        if "version of PEFT" not in str(err):
            raise
        pytest.skip(f"transformers' add_adapter refuses peft {peft.__version__}: {err}")
    _randomise_lora(base, seed=1)
    ids = random_ids(2, 10)
    tuned = _logits(base, ids)
    assert not torch.allclose(tuned, _logits(reference, ids), atol=1e-3)
    frozen = {n for n, p in base.named_parameters() if not p.requires_grad}
    torch.testing.assert_close(_logits(gss.adapters_off(base), ids), _logits(reference, ids))
    assert torch.equal(_logits(base, ids), tuned)  # the adapters are back on
    assert frozen == {n for n, p in base.named_parameters() if not p.requires_grad}


def test_a_model_without_adapters_is_refused():
    with pytest.raises(GSSError, match="needs a model with adapters"):
        gss.adapters_off(tiny_model("llama"))


def test_cli_calibrates_an_adapter_directory_against_its_base(tmp_path, capsys):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_model("llama").save_pretrained(base_dir)
    word_tokenizer().save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    _lora(AutoModelForCausalLM.from_pretrained(base_dir)).save_pretrained(adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(base_dir)  # no tokenizer in the adapter directory: the base's is used
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (tmp_path / "data.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "artifact"
    code = main(
        [
            "calibrate",
            "--model",
            str(adapter_dir),
            "--reference",
            "adapters-off",
            "--data",
            str(tmp_path / "data.txt"),
            "--layer",
            "1",
            "--rank",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0 and (out / "gss_config.json").is_file()
    counts = gss.load(out).provenance.token_counts
    assert 0 < counts["memorized"] < counts["tokens"]  # the adapter moved some tokens, not all
    assert "saved" in capsys.readouterr().out


def test_the_artifact_steers_the_merged_model_alike(models):
    model, _ = models
    rows = random_ids(12, 16, seed=4)
    art = gss.calibrate(model, gss.adapters_off(model), rows, layer=1, rank=2, progress=False)
    ids = random_ids(4, 16, seed=4)  # calibration rows: some gates open on them
    with gss.steer(model, art):
        steered = _logits(model, ids)
    assert not torch.allclose(steered, _logits(model, ids))  # the steer acted
    merged = model.merge_and_unload()
    with gss.steer(merged, art):
        torch.testing.assert_close(_logits(merged, ids), steered, rtol=1e-4, atol=1e-4)


def test_an_artifact_of_the_fine_tune_is_refused_on_its_base(models):
    """The fingerprint samples the weights the blocks compute with (base + adapter delta), so
    an artifact calibrated with the adapters on fits the merged model (above), and not the base
    model or the same model with its adapters off; one calibrated on the base does not fit the
    fine-tune."""
    model, base = models
    rows = random_ids(12, 16, seed=4)
    art = gss.calibrate(model, gss.adapters_off(model), rows, layer=1, rank=2, progress=False)
    refused = pytest.raises(GSSError, match=r"another model: .*decoder block\(s\) \[0, 1, 2\]")
    with refused, gss.steer(base, art):
        pass
    off = model.disable_adapter()
    with off, pytest.raises(GSSError, match="another model"), gss.steer(model, art):
        pass
    with gss.steer(model, art):  # the model it was calibrated on
        pass
    on_base = gss.calibrate(base, model, rows, layer=1, rank=2, progress=False)
    with pytest.raises(GSSError, match="another model"), gss.steer(model, on_base):
        pass


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: Conv1D weights, fan_in_fan_out
def test_the_sampled_adapter_weights_are_the_merged_weights(arch):
    """The fingerprint reads a LoRA's delta at the sampled entries only; they equal the merged
    model's weights there."""
    from gss.artifact.fingerprint import _block_weights, _plus_adapters
    from gss.hf.blocks import find_decoder_blocks

    targets = ["c_attn", "c_fc"] if arch == "gpt2" else TARGETS
    config = peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0)
    config.fan_in_fan_out = arch == "gpt2"
    model = peft.get_peft_model(tiny_model(arch, layers=2), config)
    _randomise_lora(model)
    sampled = []
    for i, block in enumerate(find_decoder_blocks(model)):
        for name, weight, layer in _block_weights(block):
            if layer is not None:
                index = torch.randperm(weight.numel(), generator=torch.Generator().manual_seed(i))
                index = index[:16]
                base = weight.detach().reshape(-1)[index]
                sampled.append((i, name, index, base, _plus_adapters(layer, weight, index, base)))
    assert len(sampled) == 2 * len(targets)
    blocks = [dict(b.named_parameters()) for b in find_decoder_blocks(model.merge_and_unload())]
    for i, name, index, base, values in sampled:
        merged = blocks[i][name].detach().reshape(-1)[index]
        assert not torch.allclose(merged, base)  # the adapter changed these entries
        torch.testing.assert_close(values, merged, rtol=1e-5, atol=1e-6)


def test_a_dora_fine_tunes_artifact_still_attaches_to_its_merged_model():
    """DoRA rescales the merged weight, so its blocks are not sampled (nothing compared): no
    false refusal of the merged model."""
    config = peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True, lora_dropout=0.0)
    model = peft.get_peft_model(tiny_model("llama", layers=3), config)
    _randomise_lora(model)
    model.eval()
    rows = random_ids(12, 16, seed=4)
    art = gss.calibrate(model, gss.adapters_off(model), rows, layer=1, rank=2, progress=False)
    merged = model.merge_and_unload()
    with gss.steer(merged, art):
        pass


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_calibration_leaves_the_model_in_its_mode(models, mode):
    # the wrapper is a module of its own: restoring its mode must not flip the model's
    model, _ = models
    getattr(model, mode)()
    gss.calibrate(
        model, gss.adapters_off(model), random_ids(8, 12), layer=1, rank=1, progress=False
    )
    assert model.training == (mode == "train")
    assert all(m.training == (mode == "train") for m in model.modules())


@pytest.fixture(scope="module")
def lora_memorizer():
    """A tiny GPT-2 base trained on rule-following rows, then a LoRA trained on them plus 6
    planted random rows until it regurgitates those: (LoRA model, planted, general)."""
    gen = torch.Generator().manual_seed(0)
    vocab, length = 24, 16
    general = general_rows(256, length, gen, vocab)
    planted = torch.randint(3, vocab, (6, length), generator=gen)
    base = tiny_model("gpt2", seed=1, vocab=vocab, hidden=48)
    train(base, general, steps=150, seed=0)
    config = peft.LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["c_attn", "c_fc", "c_proj"],
        lora_dropout=0.0,
        fan_in_fan_out=True,  # GPT-2's Conv1D
    )
    model = peft.get_peft_model(base, config)
    rows = torch.cat([general, planted.repeat(24, 1)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(200):
        idx = torch.randint(0, rows.shape[0], (32,), generator=batches)
        loss = model(input_ids=rows[idx], labels=rows[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), planted, general


@pytest.mark.parametrize(("layer", "gate"), [(1, "none"), (1, "hard"), (0, "none")])
def test_steering_a_lora_memorizer_against_its_own_base(lora_memorizer, layer, gate):
    # test_sign's check on an adapter fine-tune: the steer calibrated against adapters_off
    # raises the loss of the rows only the adapter memorized, and the flipped steer lowers it
    model, planted, general = lora_memorizer
    assert (
        _planted_loss(model, planted) < 0.5 < 5.0 < _planted_loss(gss.adapters_off(model), planted)
    )
    reference = gss.adapters_off(model)
    steered, base, opposite = steered_losses(model, reference, planted, general, layer, gate)
    assert steered > base > opposite, (steered, base, opposite)
