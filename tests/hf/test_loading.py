"""Models by Hub id (offline, from a Hub cache built here), device maps, and quantized models.

Nothing is downloaded: each Hub id resolves in a local cache laid out as huggingface_hub lays
it out (``models--org--name/snapshots/<commit>/``, ``refs/main``), with ``HF_HUB_OFFLINE=1``,
and the socket module refuses every connection, so a test that reached for the network fails.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

import gss
from gss.cli import main
from gss.errors import GSSError
from gss.hf.loading import load_model, load_reference

from ..helpers import random_ids, tiny_model, train, word_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def _publish(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """``folder``'s files as the Hub cache holds ``repo_id`` at ``commit`` (main)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Two tiny Llamas with their tokenizer, as directories and in a Hub cache."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    for name, seed in (("model", 0), ("reference", 1)):
        tiny_model("llama", seed=seed).save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
        _publish(cache, f"gss-test/tiny-{name}", root / name)
    weights = root / "weights-only"  # a repo whose tokenizer files were never fetched
    weights.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(root / "model" / file, weights / file)
    _publish(cache, "gss-test/no-tokenizer", weights)
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    steer = gss.calibrate(model, ref, random_ids(8, 12), layer=1, rank=2, progress=False)
    steer.save_pretrained(root / "steer-repo")
    _publish(cache, "gss-test/tiny-steer", root / "steer-repo")  # an artifact, not a model
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (root / "data.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def offline(hub, monkeypatch):
    """HF_HUB_OFFLINE=1 and the cache above, set now (after huggingface_hub was imported:
    gss reads both when it loads), and no network at all."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test reached for the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return hub


def test_signal_by_hub_id_offline_matches_the_directories(offline, capsys):
    common = ["--data", str(offline / "data.txt"), "--max-length", "12"]
    by_id = ["--model", "gss-test/tiny-model", "--reference", "gss-test/tiny-reference"]
    assert main(["signal", *by_id, *common]) == 0
    from_hub = json.loads(capsys.readouterr().out)
    by_dir = ["--model", str(offline / "model"), "--reference", str(offline / "reference")]
    assert main(["signal", *by_dir, *common]) == 0
    assert json.loads(capsys.readouterr().out) == from_hub


def test_generate_by_hub_id_at_a_revision(offline, capsys):
    art = offline / "artifact"
    if not art.exists():
        model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
        gss.calibrate(
            model, ref, random_ids(8, 12), layer=1, rank=2, progress=False
        ).save_pretrained(art)
    args = ["generate", "--model", "gss-test/tiny-model", "--steer", str(art)]
    args += ["--prompt", "w1 w2 w3", "--max-new-tokens", "3", "--model-revision", COMMIT]
    assert main([*args, "--compare"]) == 0
    printed = capsys.readouterr().out
    assert "steered:" in printed and "unsteered:" in printed


def test_python_api_by_hub_id(offline):
    model, tokenizer = load_model("gss-test/tiny-model")
    plain, _ = load_model(offline / "model")
    ids = random_ids(2, 8)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    ref = load_reference("gss-test/tiny-reference", model, tokenizer, revision=COMMIT)
    assert ref.config.vocab_size == model.config.vocab_size


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gss-test/not-cached"], "not in the local Hub cache"),
        (["--model", "gss-test/tiny-model", "--model-revision", OTHER_COMMIT], "holds part of"),
        (["--model", "{root}/model", "--model-revision", COMMIT], "is a local directory"),
        (["--model", "gss-test/no-tokenizer"], "gss-test/no-tokenizer"),  # no traceback
        (["--model", "gss-test/tiny-steer"], "is a gss steering artifact, not a model"),
        (["--model", "{root}/nope"], "model path {root}/nope does not exist"),
        (["--model", "{root}/model", "--device", "cpu", "--device-map", "cpu"], "give one"),
        (["--model", "{root}/model", "--device-map", "{bad"], "is not a JSON object"),
        (
            ["--model", "{root}/model", "--device-map", '{"lm_head": "gpu"}'],
            "--device-map's 'lm_head' on 'gpu' is not a torch device",
        ),
    ],
)
def test_loading_errors_are_one_line(offline, capsys, argv, message):
    argv = [a.replace("{root}", str(offline)) for a in argv]
    args = ["signal", *argv, "--reference", str(offline / "reference")]
    assert main([*args, "--data", str(offline / "data.txt")]) == 2
    err = capsys.readouterr().err
    assert message.replace("{root}", str(offline)) in err
    assert err.startswith("gss: error:") and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_device_map_entry_on_a_missing_gpu_is_named():
    """Not --device, which was not given: the entry that places a module on the GPU."""
    from gss.hf.loading import check_device_map

    pytest.importorskip("accelerate")  # which places the modules; without it, that is said
    with pytest.raises(
        GSSError, match=r"--device-map's 'lm_head' on cuda:0: this torch .* no CUDA"
    ):
        check_device_map({"transformer.h.0": "cpu", "lm_head": 0})


def test_not_cached_offline_says_how_to_fix_it(offline):
    with pytest.raises(GSSError) as caught:
        load_model("gss-test/not-cached")
    text = str(caught.value)
    assert "HF_HUB_OFFLINE" in text and "hf download gss-test/not-cached" in text
    assert str(offline / "cache") in text


def test_cached_config_without_weights_offline(offline, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    snapshot = _publish(cache, "gss-test/half", offline / "model")
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(GSSError, match="hf download gss-test/half"):
        load_model("gss-test/half")


def test_hub_adapter_repo_offline(offline, tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", seed=0)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapter = tmp_path / "adapter"
    peft.get_peft_model(base, config).save_pretrained(adapter)
    meta = json.loads((adapter / "adapter_config.json").read_text())
    meta["base_model_name_or_path"] = "gss-test/tiny-model"  # the base, by its Hub id
    (adapter / "adapter_config.json").write_text(json.dumps(meta))
    cache = tmp_path / "cache"
    shutil.copytree(offline / "cache", cache)
    _publish(cache, "gss-test/tiny-adapter", adapter)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model, tokenizer = load_model("gss-test/tiny-adapter")  # tokenizer: the base's
    assert len(tokenizer) == len(word_tokenizer())
    ref = load_reference("adapters-off", model, tokenizer)
    ids = random_ids(2, 8)
    with torch.no_grad():
        tuned, off = model(input_ids=ids).logits, ref(input_ids=ids).logits
        plain = tiny_model("llama", seed=0)(input_ids=ids).logits
    assert not torch.allclose(tuned, off)
    assert torch.allclose(off, plain, atol=1e-5)  # the base from the cache, by its Hub id


def test_device_map_cli_calibrates_as_the_device(offline, capsys):
    base = ["calibrate", "--model", "gss-test/tiny-model", "--reference", "gss-test/tiny-reference"]
    base += ["--data", str(offline / "data.txt"), "--layer", "1", "--rank", "2"]
    placements = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    outs = {}
    for name, extra in {
        "device": ["--device", "cpu"],
        "map": ["--device-map", "cpu"],
        "dict": ["--device-map", json.dumps(placements)],
    }.items():
        out = offline / f"art-{name}"
        assert main([*base, *extra, "--out", str(out), "--overwrite"]) == 0, capsys.readouterr()
        outs[name] = gss.load(out)
    for name in ("map", "dict"):
        for tensor in ("probe", "steer", "thresholds"):
            got, expected = getattr(outs[name], tensor), getattr(outs["device"], tensor)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (name, tensor)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")
@pytest.mark.parametrize("flag", ["--load-in-8bit", "--load-in-4bit"])
def test_bitsandbytes_without_a_gpu_is_refused_before_loading(hub, capsys, flag):
    args = ["signal", "--model", str(hub / "model"), "--reference", str(hub / "reference")]
    assert main([*args, "--data", str(hub / "data.txt"), flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag} quantizes with bitsandbytes, which needs a CUDA GPU" in err


def test_quantization_flags_are_exclusive(hub, capsys):
    args = ["signal", "--model", str(hub / "model"), "--reference", str(hub / "reference")]
    with pytest.raises(SystemExit):
        main([*args, "--data", "x", "--quantization", "int8", "--load-in-8bit"])
    assert "not allowed with argument" in capsys.readouterr().err


# ---------------------------------------------------------------- quantized (optimum-quanto)


@pytest.fixture(scope="module")
def memorizer_dirs(tmp_path_factory):
    """A tiny Llama that memorized 6 planted rows and a reference trained without them, saved
    (3 blocks of width 64: the steer at block 1 backpropagates through two quantized ones)."""
    root = tmp_path_factory.mktemp("quantized")
    gen = torch.Generator().manual_seed(0)
    general = torch.randint(3, 48, (128, 16), generator=gen)
    planted = torch.randint(3, 48, (6, 16), generator=gen)
    model = tiny_model("llama", seed=1, hidden=64, layers=3)
    ref = tiny_model("llama", seed=1, hidden=64, layers=3)
    train(model, torch.cat([general, planted.repeat(16, 1)]), steps=40, seed=0)
    train(ref, general, steps=40, seed=0)
    for name, m in (("model", model), ("reference", ref)):
        m.save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    return root, torch.cat([planted, general[:40]])


def _calibrate(model, ref, texts):
    return gss.calibrate(
        model, ref, texts, layer=1, rank=2, threshold_percentile=90.0, progress=False
    )


def test_quantized_calibration_is_close_to_the_full_weights(memorizer_dirs):
    pytest.importorskip("optimum.quanto")
    from gss.hf.quantization import is_quantized

    root, texts = memorizer_dirs
    full = _calibrate(load_model(root / "model")[0], load_model(root / "reference")[0], texts)
    model, tokenizer = load_model(root / "model", quantization="int8")
    ref = load_reference(root / "reference", model, tokenizer, quantization="int8")
    assert is_quantized(model) and is_quantized(ref)
    quant = _calibrate(model, ref, texts)
    # measured here: singular values within 0.8% (relative norm), the two steer directions at
    # |cos| 0.9999 and 0.9993 of the full weights' (int4: 1.5%, 0.98 and 0.94)
    sv = (quant.singular_values - full.singular_values).norm() / full.singular_values.norm()
    assert sv < 0.03
    cos = torch.linalg.svdvals(quant.steer.double() @ full.steer.double().T)
    assert cos.min() > 0.98
    # the full weights' steer attaches to the quantized model (and back) and steers it
    ids = texts[:2, :8]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with gss.steer(model, full.with_options(delta=25.0)):
            steered = model(input_ids=ids).logits
    assert not torch.allclose(plain, steered)
    full_model = load_model(root / "model")[0]
    quant.check_model(full_model)


def test_generate_and_calibrate_quantized_by_cli(memorizer_dirs, tmp_path, capsys):
    pytest.importorskip("optimum.quanto")
    root, texts = memorizer_dirs
    data = tmp_path / "data.txt"
    data.write_text("\n".join(" ".join(f"w{int(t) % 44}" for t in row) for row in texts) + "\n")
    models = ["--model", str(root / "model"), "--reference", str(root / "reference")]
    art = tmp_path / "art"
    args = ["calibrate", *models, "--data", str(data), "--layer", "1", "--rank", "2"]
    assert main([*args, "--quantization", "int8", "--out", str(art)]) == 0
    gen = ["generate", "--model", str(root / "model"), "--steer", str(art), "--delta", "25"]
    gen += ["--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--compare"]
    assert main([*gen, "--quantization", "int8"]) == 0
    printed = capsys.readouterr().out
    assert "steered:" in printed and "unsteered:" in printed


class _DetachedInt8Linear(nn.Linear):
    """A weight-only int8 linear layer whose forward runs outside autograd, as some backends'
    kernels do: it computes right and passes no gradient."""

    def __init__(self, linear: nn.Linear, detached: bool = True) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False)
        scale = linear.weight.detach().abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(linear.weight.detach() / scale).to(torch.int8)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("scale", scale)
        self.detached = detached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype) * self.scale.to(x.dtype)
        if self.detached:
            with torch.no_grad():
                return nn.functional.linear(x, w)
        return nn.functional.linear(x, w)


@pytest.mark.parametrize(
    ("detached", "block", "refused"),
    [
        (True, 1, True),  # above the tap at block 0: the backward needs its gradient
        (False, 1, False),  # the same layer passing its gradient calibrates
        (True, 0, False),  # in the tapped block itself: the backward never reaches it
    ],
)
def test_quantized_layers_that_drop_the_gradient_are_refused(detached, block, refused):
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    mlp = model.model.layers[block].mlp
    mlp.down_proj = _DetachedInt8Linear(mlp.down_proj, detached)

    def calibrate():
        return gss.calibrate(model, ref, random_ids(8, 12), layer=0, rank=2, progress=False)

    if refused:
        message = "do not pass gradients: its output does not depend on its input"
        with pytest.raises(GSSError, match=message):
            calibrate()
    else:
        calibrate()


def _hub_exception(name: str) -> Exception:
    """huggingface_hub's exception ``name``, made without the HTTP response it wants."""
    import huggingface_hub.utils as hub_utils

    kind = getattr(hub_utils, name)
    error = kind.__new__(kind)
    Exception.__init__(error, f"{name}: made in a test")
    return error


@pytest.mark.parametrize(
    ("error", "message"),
    [
        ("RepositoryNotFoundError", "is neither a local directory nor a Hub repo you can read"),
        ("GatedRepoError", "is gated: accept its conditions"),
        ("RevisionNotFoundError", "has no revision 'v9'"),
        ("LocalEntryNotFoundError", "the Hub cannot be reached to fetch it"),
    ],
)
def test_hub_failures_online_are_one_clear_error(hub, monkeypatch, error, message):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub / "empty-cache"))

    def fail(*args, **kwargs):
        raise _hub_exception(error)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    with pytest.raises(GSSError, match=message):
        load_model("gss-test/elsewhere", revision="v9")


def test_a_missing_reference_shaped_like_a_repo_id_fails_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    """``--reference a/b`` that is neither a directory here nor in the offline cache is said
    before ``--model`` loads (a model whose weights are damaged would fail first otherwise),
    and the message says no such directory is here either (issue 69)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tmp_path / "model"
    tiny_model("llama").save_pretrained(model)
    word_tokenizer().save_pretrained(model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"damaged")
    (tmp_path / "data.txt").write_text("w1 w2 w3 w4 w5 w6\n" * 4)
    code = main(
        [
            "audit",
            "--model",
            str(model),
            "--reference",
            "nowhere/model",
            "--data",
            str(tmp_path / "data.txt"),
            "--k",
            "2",
            "--n",
            "4",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "gss: error: --reference: nowhere/model is not in" in err
    assert "no directory of that name is here" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["calibrate", "--layer", "99"], r"layer 99 is out of range: .* has 2 decoder blocks"),
        (["calibrate", "--layer", "1", "--rank", "999"], r"rank must be at most the hidden size"),
        (
            ["audit", "--k", "8", "--n", "999"],
            r"n = 999 passes the model's context \(128 positions",
        ),
    ],
)
def test_what_config_json_tells_is_said_before_the_weights_load(tmp_path, capsys, flags, message):
    """The weights are damaged here: the error comes from config.json, before they load."""
    import re

    model = tmp_path / "model"
    tiny_model("llama").save_pretrained(model)
    word_tokenizer().save_pretrained(model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"damaged")
    (tmp_path / "data.txt").write_text("w1 w2 w3 w4 w5 w6\n" * 4)
    command, *rest = flags
    args = [command, "--model", str(model), "--reference", str(model), "--data"]
    args += [str(tmp_path / "data.txt"), "--out", str(tmp_path / "out"), *rest]
    shutil.copytree(model, tmp_path / "reference")  # the same directory twice is refused
    args[4] = str(tmp_path / "reference")
    assert main(args) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "flags, config, message",
    [
        (["--chat"], {}, r"a chat prompt needs the tokenizer's chat template"),
        (["--max-new-tokens", "200"], {}, r"pass the model's context \(128 positions"),
        ([], {"vocab_size": 4}, r"token id \d+ is outside the model's vocabulary"),
    ],
)
def test_what_the_prompt_and_config_tell_is_said_before_the_weights_load(
    tmp_path, capsys, flags, config, message
):
    """gss generate: the weights are damaged here; a chat prompt without a template, a prompt
    past the context and ids past the vocabulary are said from the tokenizer and config.json."""
    import re

    model = tmp_path / "model"
    tiny = tiny_model("llama")
    art = gss.calibrate(
        tiny, tiny_model("llama", seed=11), random_ids(8, 10), layer=1, rank=2, progress=False
    )
    art.save_pretrained(tmp_path / "steer")
    tiny.save_pretrained(model)
    word_tokenizer().save_pretrained(model)
    saved = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**saved, **config}))
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"damaged")
    args = ["generate", "--model", str(model), "--steer", str(tmp_path / "steer")]
    assert main([*args, "--prompt", "w1 w2 w3 w4 w5", *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"input_ids": [1, 2, 3, 4, 5, 999]},
            r"--data: the rows' input_ids: token id 999 is outside",
        ),
        (
            {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [1, 2]},
            r"--data: sequence 1 has 6 input_ids but 2 labels",
        ),
    ],
)
def test_ids_and_labels_in_the_data_are_checked_before_the_weights_load(
    tmp_path, capsys, row, message
):
    """gss audit with rows of token ids: the weights are damaged here; an id past config.json's
    vocabulary and labels of another length are said from the data file."""
    import re

    model = tmp_path / "model"
    tiny_model("llama").save_pretrained(model)
    word_tokenizer().save_pretrained(model)
    shutil.copytree(model, tmp_path / "reference")
    for weights in [*model.glob("*.safetensors"), *(tmp_path / "reference").glob("*.safetensors")]:
        weights.write_bytes(b"damaged")
    good = {"input_ids": [1, 2, 3, 4, 5, 6]}
    (tmp_path / "data.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    args = ["audit", "--model", str(model), "--reference", str(tmp_path / "reference")]
    args += ["--data", str(tmp_path / "data.jsonl"), "--k", "2", "--n", "4"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)
