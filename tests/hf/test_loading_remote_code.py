"""A model folder's own Python is never run (issue 69): gss passes ``trust_remote_code=False`` to
every ``from_pretrained``, so transformers neither runs an ``auto_map`` module nor asks on stdin
whether to (a ``y`` there used to run it). A built-in architecture loads as itself; a folder
whose only code is its own fails with one message."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from gss import GSSError
from gss.hf.loading import load_model

from ..helpers import tiny_model, word_tokenizer

HOSTILE = """
from pathlib import Path
Path(__file__).with_name("RAN").write_text("custom code ran")
from transformers import LlamaConfig, LlamaForCausalLM
class HostileConfig(LlamaConfig):
    model_type = "hostile"
class HostileModel(LlamaForCausalLM):
    config_class = HostileConfig
"""


def _hostile_folder(root: Path, model_type: str) -> Path:
    folder = root / model_type
    tiny_model("llama").save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    (folder / "hostile.py").write_text(HOSTILE)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {
        "AutoConfig": "hostile.HostileConfig",
        "AutoModelForCausalLM": "hostile.HostileModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_model_folders_own_code_never_runs(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("y\ny\ny\n"))  # what used to run it
    built_in = _hostile_folder(tmp_path, "llama")  # a built-in type with an auto_map
    model, _ = load_model(str(built_in))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not (built_in / "RAN").exists()
    custom = _hostile_folder(tmp_path, "hostile")  # nothing but its own code
    with pytest.raises(GSSError, match="could not load"):
        load_model(str(custom))
    assert not (custom / "RAN").exists()


def test_a_pickled_weights_file_and_a_config_nested_too_deep_are_one_message(tmp_path):
    """torch's restricted unpickler refuses a pickle that would run code (no code runs): said
    as one GSSError, not a traceback; an artifact config nested past Python's recursion limit
    too (issue 69)."""
    import pickle

    import gss

    class Payload:
        def __reduce__(self):
            return (print, ("pickled code ran",))

    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(GSSError, match="could not load the model"):
        load_model(str(folder))
    art = tmp_path / "art"
    art.mkdir()
    (art / "gss_config.json").write_text("[" * 100000 + "]" * 100000)
    (art / "gss_tensors.safetensors").write_bytes(b"")
    with pytest.raises(GSSError, match="is not valid JSON"):
        gss.load(art)


def test_a_model_folder_without_tokenizer_files_is_said_so(tmp_path):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    with pytest.raises(GSSError, match=r"holds no tokenizer files .*tokenizer\.save_pretrained"):
        load_model(str(folder))


def test_audit_warns_when_the_tokenizer_is_another_models(memorizer):
    """Another model's tokenizer gives other ids, on which nothing reads as memorized: the audit
    says the tokenizer does not look like the model's (issue 69)."""
    import warnings

    import gss

    from ..helpers import word_tokenizer

    model, reference, _, _ = memorizer
    foreign = word_tokenizer(["<pad>", "<x>", "<y>", "<eos>", "w1", "w2"])  # eos id 3, not 2
    texts = ["w1 w2 w1 w2 w1 w2 w1 w2"] * 2
    with pytest.warns(gss.GSSWarning, match="does not look like the model's"):
        gss.audit(model, reference, texts, tokenizer=foreign, k=2, n=6, progress=False)
    own = word_tokenizer()  # the tiny models' own ids (end of sequence: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gss.GSSWarning)
        gss.audit(
            model, reference, ["w1 w2 w3 w4 w5 w6 w7"], tokenizer=own, k=2, n=6, progress=False
        )
