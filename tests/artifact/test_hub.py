"""Artifacts on the Hugging Face Hub, never over the network.

Loading by repo id reads a Hub cache laid out here as huggingface_hub lays it out
(``models--org--name/{blobs,refs,snapshots}``), with ``HF_HUB_OFFLINE`` on; pushing runs with
`HfApi`'s network methods replaced by fakes that record what they were asked and keep the
uploaded folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from huggingface_hub import HfApi, constants
from transformers import AutoModelForCausalLM

import gss
from gss import GSSError, GSSWarning
from gss.artifact import card as cards
from gss.artifact import hub
from gss.cli import main

from ..helpers import at_block, random_ids, tiny_model, word_tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "hub.md"

MAIN = "a" * 40  # commit hashes
OTHER = "b" * 40


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch):
    """An empty Hub cache in tmp_path, named by HF_HUB_CACHE, and HF_HUB_OFFLINE=1, both set
    in this process after huggingface_hub read its constants: gss reads them when it loads.
    huggingface_hub's own offline switch is on too, so that no test can reach the network."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert str(cache) != constants.HF_HUB_CACHE  # not the cache huggingface_hub read at import
    return cache


def go_offline(monkeypatch):
    """After a (faked) push: loading reads the cache only."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny model saved with its tokenizer (so its name is its directory), and an artifact
    calibrated on it."""
    root = tmp_path_factory.mktemp("hub")
    tiny_model("llama", seed=3).save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    ref = tiny_model("llama", seed=11)
    art = gss.calibrate(model, ref, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False)
    return root, model, art.with_options(delta=25.0)


def put_in_cache(cache: Path, repo_id: str, folder: Path, commit: str, ref: str | None = "main"):
    """``folder``'s files as huggingface_hub caches a snapshot: content-addressed blobs, the
    snapshot's files as relative symlinks to them, and ``refs/<ref>`` holding the commit."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def logits_with(model, steer, ids):
    with torch.no_grad(), gss.steer(model, steer):
        return model(input_ids=ids).logits


def assert_same_artifact(a, b):
    for name in ("probe", "steer", "thresholds", "offset", "singular_values"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.config == b.config and a.provenance == b.provenance


# --- loading by repo id ---------------------------------------------------------------------


def test_load_by_repo_id_reads_the_offline_cache(made, offline_cache, tmp_path):
    _, model, art = made
    art.save_pretrained(tmp_path / "art")
    snapshot = put_in_cache(offline_cache, "org/name", tmp_path / "art", MAIN)
    assert (snapshot / "gss_config.json").is_symlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the README (and the cache's links) raise no warning
        loaded = gss.load("org/name")
        by_class = gss.SteeringArtifact.from_pretrained("org/name")
    assert_same_artifact(loaded, art)
    assert_same_artifact(by_class, art)
    ids = random_ids(2, 10, seed=5)
    assert torch.equal(logits_with(model, loaded, ids), logits_with(model, art, ids))


def test_load_by_repo_id_at_a_revision(made, offline_cache, tmp_path):
    _, _, art = made
    art.save_pretrained(tmp_path / "main")
    art.with_options(delta=4.0).save_pretrained(tmp_path / "v1")
    put_in_cache(offline_cache, "org/name", tmp_path / "main", MAIN)
    put_in_cache(offline_cache, "org/name", tmp_path / "v1", OTHER, ref="v1")
    assert gss.load("org/name").config.delta == 25.0
    assert gss.load("org/name", revision="v1").config.delta == 4.0
    assert gss.load("org/name", revision=OTHER).config.delta == 4.0  # a commit hash
    assert gss.load("org/name", revision=MAIN).config.delta == 25.0
    with pytest.raises(
        GSSError, match=r"org/name \(revision 'v2'\) is not in the local Hub cache \("
    ):
        gss.load("org/name", revision="v2")


def test_a_stack_loads_by_repo_id(made, offline_cache, tmp_path):
    _, model, art = made
    stack = gss.SteeringStack((art, at_block(art.with_options(delta=2.0), 0)))
    stack.save_pretrained(tmp_path / "stack")
    assert (tmp_path / "stack" / "README.md").is_file()
    put_in_cache(offline_cache, "org/stack", tmp_path / "stack", MAIN)
    loaded = gss.load("org/stack")
    assert isinstance(loaded, gss.SteeringStack) and loaded.layers == stack.layers
    for a, b in zip(loaded, stack, strict=True):
        assert_same_artifact(a, b)
    assert isinstance(gss.SteeringStack.from_pretrained("org/stack"), gss.SteeringStack)
    with pytest.raises(GSSError, match="is a steering stack"):
        gss.SteeringArtifact.from_pretrained("org/stack")
    ids = random_ids(2, 10, seed=5)
    assert torch.equal(logits_with(model, loaded, ids), logits_with(model, stack, ids))


def test_offline_and_not_cached_is_one_clear_error(offline_cache, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("asked the Hub while HF_HUB_OFFLINE=1")

    # only the environment says offline (set after huggingface_hub's import): still obeyed
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "repo_info", no_network)
    monkeypatch.setattr(HfApi, "list_repo_tree", no_network)
    with pytest.raises(GSSError) as caught:
        gss.load("org/missing")
    message = str(caught.value)
    assert (
        f"org/missing is not in the local Hub cache ({offline_cache}) and HF_HUB_OFFLINE is set"
        in message
    )
    assert "hf download org/missing" in message and "\n" not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no HF trace


def test_local_paths_keep_their_messages(made, tmp_path, monkeypatch):
    _, _, art = made
    monkeypatch.chdir(tmp_path)
    for missing in (str(tmp_path / "nope"), "nope", "./org/name", Path("org/name")):
        with pytest.raises(GSSError, match="is not a gss artifact directory"):
            gss.load(missing)  # a path, not a repo id: no Hub look-up
    art.save_pretrained(tmp_path / "org" / "name")
    assert hub.hub_repo_id("org/name") is None  # a local directory wins over a repo id
    assert gss.load("org/name").config == art.config
    with pytest.raises(GSSError, match=r"revision='v1' names a revision of a Hub repo"):
        gss.load("org/name", revision="v1")


def test_a_repo_without_an_artifact_is_refused(offline_cache, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    put_in_cache(offline_cache, "org/a-model", tmp_path / "model", MAIN)
    with pytest.raises(GSSError, match="the Hub repo org/a-model holds no gss artifact"):
        gss.load("org/a-model")


def _http_error(kind, status):
    response = SimpleNamespace(headers={}, request=None, status_code=status)
    return kind("the Hub said no", response=response)


@pytest.mark.parametrize(
    ("error", "message"),
    [
        ("RepositoryNotFoundError", "org/name is neither a local directory nor a Hub repo"),
        ("RevisionNotFoundError", "the Hub repo org/name has no revision 'v9'"),
        ("GatedRepoError", "the Hub repo org/name is gated"),
        ("HfHubHTTPError", r"the Hub refused to send org/name \(revision 'v9'\) \(HTTP 500\)"),
    ],
)
def test_hub_errors_are_one_line(monkeypatch, error, message):
    import huggingface_hub
    from huggingface_hub import errors

    def fail(*args, **kwargs):
        raise _http_error(getattr(errors, error), 404 if error != "HfHubHTTPError" else 500)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(GSSError, match=message) as caught:
        gss.load("org/name", revision="v9")
    assert "\n" not in str(caught.value)


# --- pushing --------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """HfApi's network calls replaced: each call recorded; the last uploaded folder copied to
    ``remote`` (the temporary folder is gone after the push); ``readme`` is what the repo's
    README.md holds (None: it has none)."""
    from huggingface_hub.errors import EntryNotFoundError

    state = SimpleNamespace(calls=[], remote=None, readme=None)
    monkeypatch.delenv("HF_HUB_OFFLINE")  # pushing needs the network; every call is faked
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def record(name):
        def method(self, *args, **kwargs):
            state.calls.append((name, args, kwargs))

        return method

    def download(self, repo_id, filename, **kwargs):
        state.calls.append(("hf_hub_download", (repo_id, filename), kwargs))
        if state.readme is None:
            raise EntryNotFoundError(f"{filename} is not in {repo_id}")
        path = tmp_path / "downloaded-README.md"
        path.write_text(state.readme)
        return str(path)

    def upload(self, **kwargs):
        state.calls.append(("upload_folder", (), kwargs))
        state.remote = tmp_path / f"remote-{len(calls(state, 'upload_folder'))}"
        shutil.copytree(kwargs["folder_path"], state.remote)
        return SimpleNamespace(commit_url="https://huggingface.co/org/name/commit/1", pr_url=None)

    monkeypatch.setattr(HfApi, "create_repo", record("create_repo"))
    monkeypatch.setattr(HfApi, "create_branch", record("create_branch"))
    monkeypatch.setattr(HfApi, "hf_hub_download", download)
    monkeypatch.setattr(HfApi, "upload_folder", upload)
    return state


def calls(state, name):
    return [(args, kwargs) for n, args, kwargs in state.calls if n == name]


def test_push_to_hub_uploads_what_loads_back(made, fake_hub, offline_cache, monkeypatch):
    _, model, art = made
    info = art.push_to_hub(
        "org/name", revision="dev", private=True, commit_message="first steer", token="hf_x"
    )
    assert info.commit_url.endswith("/commit/1")
    [(args, kwargs)] = calls(fake_hub, "create_repo")
    assert args == ("org/name",) and kwargs["private"] is True and kwargs["exist_ok"] is True
    [(args, kwargs)] = calls(fake_hub, "create_branch")
    assert args == ("org/name",) and kwargs["branch"] == "dev" and kwargs["exist_ok"] is True
    [(_, upload)] = calls(fake_hub, "upload_folder")
    assert upload["repo_id"] == "org/name" and upload["revision"] == "dev"
    assert upload["commit_message"] == "first steer" and upload["create_pr"] is False
    assert "gss_stack.json" in upload["delete_patterns"]  # an earlier push's stack goes
    names = sorted(p.name for p in fake_hub.remote.iterdir())
    assert names == ["README.md", "gss_config.json", "gss_tensors.safetensors"]
    readme = (fake_hub.remote / "README.md").read_text()
    assert 'gss.load("org/name")' in readme and cards.is_generated(readme)
    assert_same_artifact(gss.load(fake_hub.remote), art)
    go_offline(monkeypatch)
    put_in_cache(offline_cache, "org/name", fake_hub.remote, MAIN)  # as a download caches it
    ids = random_ids(2, 10, seed=5)
    assert torch.equal(logits_with(model, gss.load("org/name"), ids), logits_with(model, art, ids))


def test_push_defaults_and_a_stack(made, fake_hub):
    _, _, art = made
    stack = gss.SteeringStack((art, at_block(art.with_options(delta=2.0), 0)))
    stack.push_to_hub("org/stack", create_pr=True)
    assert not calls(fake_hub, "create_branch")  # no revision: the main branch
    [(_, create)] = calls(fake_hub, "create_repo")
    assert create["private"] is None  # an existing repo keeps its visibility
    [(_, upload)] = calls(fake_hub, "upload_folder")
    assert upload["revision"] is None and upload["create_pr"] is True
    assert upload["commit_message"] == "Upload gss steering stack (blocks [1, 0])"
    assert (fake_hub.remote / "gss_stack.json").is_file()
    assert sorted(p.name for p in (fake_hub.remote / "steer-1").iterdir()) == [
        "gss_config.json",
        "gss_tensors.safetensors",
    ]
    loaded = gss.load(fake_hub.remote)
    assert isinstance(loaded, gss.SteeringStack)
    assert [a.config.delta for a in loaded] == [25.0, 2.0]


def test_push_keeps_a_readme_gss_did_not_write(made, fake_hub):
    _, _, art = made
    fake_hub.readme = "# our steer\n\nwritten by hand\n"
    with pytest.warns(GSSWarning, match="kept the README.md of org/name"):
        art.push_to_hub("org/name")
    assert not (fake_hub.remote / "README.md").exists()  # not uploaded: the Hub's stays
    [(_, upload)] = calls(fake_hub, "upload_folder")
    assert not any("README" in p for p in upload["delete_patterns"])


def test_push_replaces_its_own_card_and_uploads_a_card_given(made, fake_hub, tmp_path):
    _, _, art = made
    fake_hub.readme = cards.model_card(art.with_options(delta=4.0), "org/name")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GSSWarning)
        art.push_to_hub("org/name")
    assert "| 25 |" in (fake_hub.remote / "README.md").read_text()  # this artifact's card
    fake_hub.readme = "# someone's\n"
    art.push_to_hub("org/name", model_card="# my card\n")  # asked for: uploaded
    assert (fake_hub.remote / "README.md").read_text() == "# my card\n"


def test_push_refusals_are_one_line(made, fake_hub, monkeypatch):
    from huggingface_hub.errors import HfHubHTTPError

    _, _, art = made
    for bad in ("name", "org/name/more", "../x", ""):
        with pytest.raises(GSSError, match="repo_id must be a Hub repo id"):
            art.push_to_hub(bad)
    assert not fake_hub.calls  # refused before any call

    def exists(self, *args, **kwargs):
        raise _http_error(HfHubHTTPError, 409)

    monkeypatch.setattr(HfApi, "create_repo", exists)
    with pytest.raises(GSSError, match="already exists: pass exist_ok=True"):
        art.push_to_hub("org/name", exist_ok=False)

    def forbidden(self, *args, **kwargs):
        raise _http_error(HfHubHTTPError, 403)

    monkeypatch.setattr(HfApi, "create_repo", forbidden)
    with pytest.raises(GSSError, match=r"refused the push to org/name \(HTTP 403\): log in"):
        art.push_to_hub("org/name")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(GSSError, match="needs the network, and HF_HUB_OFFLINE is set"):
        art.push_to_hub("org/name")


# --- the model card -------------------------------------------------------------------------


def test_the_card_says_what_the_steer_is_and_how_to_use_it(made):
    root, _, art = made
    text = cards.model_card(art, "org/name")
    meta = yaml.safe_load(cards.front_matter(text))
    assert meta["library_name"] == "gss"
    assert set(cards.TAGS) <= set(meta["tags"])
    assert "base_model" not in meta  # the model's name is a local directory, not a Hub id
    assert str(root / "model") in text  # the model it steers, by the name it was loaded by
    row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    for shown in ("GSS-TR", "| 2 |", "| 25 |", "hard", "p95", "projection", "covariance"):
        assert shown in row, shown
    counts = art.provenance.token_counts
    assert f"{counts['tokens']} tokens in {counts['sequences']} sequences" in text
    assert f"{counts['memorized']} marked memorized" in text
    assert "records no measurement" in text and "gss evaluate --steer org/name" in text
    assert 'gss.load("org/name")' in text and "gss.steer(model, artifact)" in text
    assert "gss generate --model" in text and "--steer org/name" in text
    assert cards.is_generated(text)
    assert not cards.is_generated(text.replace("hard", "soft", 1))  # edited: not gss's
    assert not cards.is_generated("# a README\n")


def test_the_cards_python_example_runs(made, offline_cache, tmp_path, capsys):
    _, _, art = made
    art.save_pretrained(tmp_path / "art")
    put_in_cache(offline_cache, "org/name", tmp_path / "art", MAIN)
    text = cards.model_card(art, "org/name")
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None
    exec(compile(block.group(1), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_the_card_names_a_hub_model_and_what_was_measured(made):
    _, _, art = made
    fingerprint = {**art.provenance.fingerprint, "name_or_path": "org/base-model"}
    sweep = {
        "options": {"delta": 4.0, "rank": 2, "threshold_percentile": None},
        "memorized": 12.5,
        "perplexity": 10.5,
        "unsteered_perplexity": 10.0,
        "tolerance": 0.05,
    }
    provenance = dataclasses.replace(
        art.provenance, fingerprint=fingerprint, extra={"sweep": sweep}
    )
    swept = dataclasses.replace(art, provenance=provenance)
    text = cards.model_card(swept, "org/steer")
    assert yaml.safe_load(cards.front_matter(text))["base_model"] == "org/base-model"
    assert 'from_pretrained("org/base-model")' in text
    assert "`gss sweep` selected this point (delta 4.0, rank 2)" in text
    assert "12.5% of the memorized rows" in text and "10.5 against 10 unsteered (+5.0%)" in text
    protect = {
        "heldout_rows": 8,
        "before": {"memorized": 75.0, "utility": 3.2},
        "after": {"memorized": 0.0, "utility": 3.3},
        "budget": {"measure": "perplexity on general text", "limit": 3.36},
        "target": 0.0,
        "reached": True,
        "gate_open_share": {"general (given)": 0.102, "reference-generated": 0.12},
        "handoff": {"gates": "none", "rules": {}},
    }
    provenance = dataclasses.replace(art.provenance, extra={"protect": protect})
    stack = gss.SteeringStack((dataclasses.replace(art, provenance=provenance), at_block(art, 0)))
    text = cards.model_card(stack, "org/steer")
    assert text.startswith("---\n") and "# gss steering stack (blocks [1, 0])" in text
    assert "on 8 held-out memorized rows" in text
    assert "| unsteered | 75.0% | 3.2 |" in text and "| steered | 0.0% | 3.3 |" in text
    assert "(reached)" in text and "- Block 1:" in text
    assert (
        "held out of setting the thresholds, the gates opened on 10.2% of general (given), 12.0%"
        in text
    )
    assert "`gss generate --reference-where-open REF`), it speaks at any step" in text
    # Sigma_gen's tokens are those it was computed from (held-out general text, when given)
    facts = {**art.provenance.soundness, "general_tokens": 900}
    provenance = dataclasses.replace(art.provenance, soundness=facts)
    assert "900 general tokens for Sigma_gen" in cards.model_card(
        dataclasses.replace(art, provenance=provenance), "org/steer"
    )


def test_save_never_overwrites_a_readme_someone_wrote(made, tmp_path):
    _, _, art = made
    art.save_pretrained(tmp_path / "a")
    card = tmp_path / "a" / "README.md"
    assert cards.is_generated(card.read_text()) and str(tmp_path / "a") in card.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GSSWarning)
        art.with_options(delta=3.0).save_pretrained(tmp_path / "a", overwrite=True)
    assert "| 3 |" in card.read_text()  # its own card, unedited: replaced with the artifact
    card.write_text(card.read_text() + "\nOur notes.\n")
    with pytest.warns(GSSWarning, match=r"kept .*README\.md: gss did not write it"):
        art.save_pretrained(tmp_path / "a", overwrite=True)
    assert card.read_text().endswith("Our notes.\n")  # kept, the artifact replaced
    assert gss.load(tmp_path / "a").config.delta == 25.0
    with pytest.raises(GSSError, match="already holds a gss artifact"):
        art.save_pretrained(tmp_path / "a")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("# a project\n")
    for overwrite in (False, True):  # a README alone is someone's folder: never written into
        with pytest.raises(GSSError, match="holds files that are not a gss artifact's"):
            art.save_pretrained(tmp_path / "docs", overwrite=overwrite)
    assert [p.name for p in (tmp_path / "docs").iterdir()] == ["README.md"]


# --- the command line -----------------------------------------------------------------------


def test_gss_push_and_show_by_repo_id(made, fake_hub, offline_cache, tmp_path, capsys, monkeypatch):
    _, _, art = made
    art.save_pretrained(tmp_path / "art")
    argv = ["push", str(tmp_path / "art"), "org/name", "--revision", "dev", "--private"]
    assert main([*argv, "--commit-message", "a steer"]) == 0
    printed = capsys.readouterr().out
    assert "pushed" in printed and "gss show org/name --revision dev" in printed
    [(_, upload)] = calls(fake_hub, "upload_folder")
    assert upload["revision"] == "dev" and upload["commit_message"] == "a steer"
    [(_, create)] = calls(fake_hub, "create_repo")
    assert create["private"] is True
    readme = (fake_hub.remote / "README.md").read_text()
    assert 'gss.load("org/name")' in readme and str(tmp_path / "art") not in readme
    go_offline(monkeypatch)
    put_in_cache(offline_cache, "org/name", fake_hub.remote, MAIN, ref="dev")
    assert main(["show", "org/name", "--revision", "dev"]) == 0
    assert capsys.readouterr().out.strip() == art.describe()
    assert main(["show", "org/name", "--revision", "dev", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == art.config.to_dict()
    assert main(["show", "org/missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gss: error: org/missing is not in the local Hub cache (") and (
        "\n" not in err
    )


def test_gss_push_uploads_the_readme_you_edited(made, fake_hub, tmp_path, capsys):
    _, _, art = made
    art.save_pretrained(tmp_path / "art")
    (tmp_path / "art" / "README.md").write_text("# edited by us\n")
    assert main(["push", str(tmp_path / "art"), "org/name"]) == 0
    assert "as the model card (you wrote or edited it)" in capsys.readouterr().out
    assert (fake_hub.remote / "README.md").read_text() == "# edited by us\n"
    assert main(["push", str(tmp_path / "nope"), "org/name"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_gss_generate_steers_with_a_repo_id(made, offline_cache, tmp_path, capsys):
    root, _, art = made
    art.save_pretrained(tmp_path / "art")
    put_in_cache(offline_cache, "org/name", tmp_path / "art", MAIN)
    common = ["--model", str(root / "model"), "--prompt", "w1 w2 w3", "--max-new-tokens", "4"]
    assert main(["generate", *common, "--steer", str(tmp_path / "art")]) == 0
    local = capsys.readouterr().out
    assert main(["generate", *common, "--steer", "org/name"]) == 0
    assert capsys.readouterr().out == local


def test_the_docs_examples_run(made, fake_hub, offline_cache, tmp_path, monkeypatch):
    """docs/hub.md's Python examples, as written: the push (faked), then the load by id and
    revision from the offline cache, steering the model the artifact was calibrated on."""
    root, _, art = made
    push, load = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(root / "model", tmp_path / "my-finetune")
    art.save_pretrained(tmp_path / "gss-artifact")
    exec(compile(push, "hub.md", "exec"), {})
    uploads = [kwargs for _, kwargs in calls(fake_hub, "upload_folder")]
    assert [u["repo_id"] for u in uploads] == ["your-org/llama-ft-steer"] * 2
    assert [u["revision"] for u in uploads] == [None, "v1"]
    assert uploads[1]["commit_message"] == "delta 4"
    go_offline(monkeypatch)
    put_in_cache(offline_cache, "your-org/llama-ft-steer", tmp_path / "remote-1", MAIN)
    put_in_cache(offline_cache, "your-org/llama-ft-steer", tmp_path / "remote-2", OTHER, "v1")
    namespace: dict = {}
    exec(compile(load, "hub.md", "exec"), namespace)
    assert_same_artifact(namespace["artifact"], art)
    assert_same_artifact(namespace["pinned"], art)
