"""Artifacts that cannot lie about themselves (issue 69): a config edited by hand, a config
missing a field, a checksum removed, a version that is a string, a stack listing one member
twice, the same artifact loaded twice and attached twice."""

from __future__ import annotations

import json
import warnings

import pytest

import gss
from gss import GSSError, GSSWarning
from gss.artifact.steering_artifact import SteeringArtifact

from ..helpers import calibrated_llama, tiny_model


@pytest.fixture(scope="module")
def steered():
    return calibrated_llama(layers=3)


def _saved(tmp_path, art, edit=None):
    art.save_pretrained(tmp_path / "a")
    path = tmp_path / "a" / "gss_config.json"
    if edit is not None:
        raw = json.loads(path.read_text())
        edit(raw)
        path.write_text(json.dumps(raw))
    return tmp_path / "a"


def test_a_saved_artifact_loads_as_it_was(tmp_path, steered):
    _, art = steered
    assert gss.load(_saved(tmp_path, art)) == art


def _as_format_2(raw):
    """The file as gss wrote it before format 3 (no content checksum)."""
    raw.pop("content_sha256")
    raw["format_version"] = 2
    return raw


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r["config"].update(layer=0), "does not match its own checksum"),
        (lambda r: r["config"].update(delta=1.0), "does not match its own checksum"),
        (lambda r: r["provenance"].update(layers_scanned=[9]), "does not match its own"),
        (lambda r: r["config"].pop("target"), r"its config lacks \['target'\]"),
        (lambda r: r.pop("tensors_sha256"), "does not match its own checksum"),
        (lambda r: r.update(tensors_sha256=None), "does not match its own checksum"),
        (lambda r: _as_format_2(r).pop("tensors_sha256"), "records no SHA-256"),
        (lambda r: _as_format_2(r).update(tensors_sha256=None), "records no SHA-256"),
        (lambda r: r.update(format_version="3"), "format_version is '3', not a version"),
    ],
)
def test_a_config_that_lies_is_refused(tmp_path, steered, edit, message):
    _, art = steered
    with pytest.raises(GSSError, match=message):
        gss.load(_saved(tmp_path, art, edit))


def test_an_artifact_of_an_older_format_loads_and_says_nothing_seals_it(tmp_path, steered):
    """Format 2 had no checksum of its config: such a file (or a format-3 one relabelled 2 to
    skip the check, its delta edited) loads as before, and warns that an edit goes unseen."""
    _, art = steered

    def relabelled(raw):
        _as_format_2(raw)["config"]["delta"] = 50.0

    with pytest.warns(GSSWarning, match="format 2, whose config no checksum covers"):
        assert gss.load(_saved(tmp_path, art, relabelled)).config.delta == 50.0


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["timings"].update(total=None),
        lambda m: m.update(soundness={**m.get("soundness", {}), "warnings": 5}),
        lambda m: m["gate_open_share"].update(per_direction="x"),
    ],
)
def test_a_sealed_provenance_of_the_wrong_kind_is_described_as_damaged(tmp_path, steered, edit):
    """A forger's provenance (sealed again) whose values are of the wrong kind: `describe`
    (gss show) says the artifact is damaged, not a traceback from the formatting."""
    from ..helpers import sealed

    _, art = steered

    def forged(raw):
        edit(raw["provenance"])
        sealed(raw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GSSWarning)  # unknown entries, if any
        loaded = gss.load(_saved(tmp_path, art, forged))
    with pytest.raises(GSSError, match="provenance holds a value of the wrong kind"):
        loaded.describe()


def test_a_stack_refuses_one_steer_twice(tmp_path, steered):
    _, art = steered
    with pytest.raises(GSSError, match=r"holds two steers of block 1 \(or one twice\)"):
        gss.SteeringStack((art, art))
    other = art.with_options(delta=art.config.delta * 2)  # the same block, another strength
    with pytest.raises(GSSError, match="one steer per block"):
        gss.SteeringStack((art, other))
    second = (
        gss.calibrate(
            steered[0],
            steered[0],
            [[5, 6, 7, 8, 9, 10, 11, 12]] * 4,
            layer=2,
            rank=1,
            progress=False,
        )
        if False
        else None
    )
    del second
    stack = gss.SteeringStack((art,))
    stack.save_pretrained(tmp_path / "s")
    manifest = tmp_path / "s" / "gss_stack.json"
    raw = json.loads(manifest.read_text())
    raw["members"] = raw["members"] * 2
    manifest.write_text(json.dumps(raw))
    with pytest.raises(GSSError, match="twice: the stack is damaged"):
        gss.load(tmp_path / "s")


def test_the_same_artifact_loaded_twice_warns_when_attached_twice(tmp_path, steered):
    model, art = steered
    path = _saved(tmp_path, art)
    first, second = SteeringArtifact.from_pretrained(path), SteeringArtifact.from_pretrained(path)
    assert first is not second and first.probe is not second.probe
    with (
        first.attach(model),
        pytest.warns(GSSWarning, match="already steers this block"),
        second.attach(model),
    ):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with first.attach(model):  # once: no warning
            pass


def test_overwrite_replaces_only_what_gss_wrote(tmp_path, memorizer):
    """--overwrite (overwrite=True) replaces a results file a gss run wrote there, as written,
    and never one the user wrote or changed since (issue 69: a user's audit.md was replaced)."""
    model, reference, planted, _ = memorizer
    report = gss.audit(model, reference, planted.tolist(), k=4, n=16, progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "audit.md").write_text("my notes\n")
    with pytest.raises(GSSError, match=r"audit.md was not written by gss"):
        report.write(mine, overwrite=True)
    assert (mine / "audit.md").read_text() == "my notes\n"
    ours = tmp_path / "ours"
    report.write(ours)
    report.write(ours, overwrite=True)  # its own files, as written: replaced
    (ours / "audit.md").write_text("edited since\n")
    with pytest.raises(GSSError, match=r"was not written by gss \(or was changed since\)"):
        report.write(ours, overwrite=True)


def test_no_record_or_card_goes_through_a_link(tmp_path, memorizer, steered):
    """gss's record of what it wrote (``.gss-written.json``) as a link or a folder is refused
    before any work, and rewritten by a rename, never through a link; a save over an artifact
    whose README.md is a link is refused (it would copy the linked file in)."""
    from gss.artifact.files import WRITTEN, record_outputs

    model, reference, planted, _ = memorizer
    report = gss.audit(model, reference, planted.tolist(), k=4, n=16, progress=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("my notes\n")
    linked, folder, raced = tmp_path / "linked", tmp_path / "folder" / WRITTEN, tmp_path / "raced"
    for d in (linked, folder, raced):
        d.mkdir(parents=True)
    (linked / WRITTEN).symlink_to(victim)
    with pytest.raises(GSSError, match=r"gss-written.json is a link"):
        report.write(linked)
    with pytest.raises(GSSError, match=r"gss-written.json is not a regular file"):
        report.write(folder.parent)
    (raced / "audit.md").write_text("written\n")
    (raced / WRITTEN).symlink_to(victim)  # planted after the check: replaced, not followed
    record_outputs(raced, ["audit.md"])
    assert victim.read_text() == "my notes\n" and not (raced / WRITTEN).is_symlink()
    _, art = steered
    art.save_pretrained(tmp_path / "a")
    (tmp_path / "a" / "README.md").unlink()
    (tmp_path / "a" / "README.md").symlink_to(victim)
    with pytest.raises(GSSError, match=r"README.md is a link"):
        art.save_pretrained(tmp_path / "a", overwrite=True)


def test_no_artifact_is_saved_inside_a_model_or_another_artifact(tmp_path, steered):
    """A steer saved into a model's folder, or into another artifact, would travel with it
    when that folder is copied or uploaded: refused, as results are."""
    model, art = steered
    model.save_pretrained(tmp_path / "model")
    art.save_pretrained(tmp_path / "art")
    for inside in (tmp_path / "model" / "steer", tmp_path / "art" / "sub" / "steer"):
        with pytest.raises(GSSError, match=r"is inside .*, which holds a (model|gss artifact)"):
            art.save_pretrained(inside)
        assert not inside.exists()


def test_protect_writes_no_steer_through_a_link(tmp_path):
    """A steer/ that links elsewhere is refused before any work: a save would write through it
    into an artifact outside --out (issue 69)."""
    from gss.protect.result import check_report_dir

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "steer").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(GSSError, match=r"is a link .*protect writes its steer into"):
        check_report_dir(out, overwrite=True)


def test_an_overwrite_killed_between_its_renames_is_restored_and_said(tmp_path, steered):
    """A kill between the two renames of an overwrite leaves the old artifact set aside and
    nothing at the path: loading says where it is, the next save puts it back and says so."""
    _, art = steered
    out = tmp_path / "a"
    art.save_pretrained(out)
    aside = tmp_path / ".a.old-killed"
    aside.mkdir()
    out.rename(aside / "artifact")  # what the kill left
    with pytest.raises(GSSError, match="An interrupted save set it aside in"):
        gss.load(out)
    with (
        pytest.warns(GSSWarning, match=r"restored .* stopped between its two renames"),
        pytest.raises(GSSError, match="already holds a gss artifact"),
    ):
        art.save_pretrained(out)  # no overwrite asked: the restored one stays
    assert gss.load(out) == art and not aside.exists()


def test_options_that_would_be_silently_dropped_or_overflow_are_refused(memorizer):
    """A config with both of a pair one of which replaces the other's rule, an absurd delta,
    and a progress flag that is not a bool are refused, not silently read (issue 69)."""
    from gss.config import CalibrationConfig

    with pytest.raises(GSSError, match="gate_share replaces threshold_percentile's rule"):
        CalibrationConfig(gate_share=0.05, threshold_percentile=90.0)
    with pytest.raises(GSSError, match="memorized_quantile replaces omega_threshold's rule"):
        CalibrationConfig(memorized_quantile=0.05, omega_threshold=1.0)
    with pytest.raises(GSSError, match="delta must be at most 1e"):
        CalibrationConfig(delta=1e30)
    model, reference, planted, _ = memorizer
    with pytest.raises(GSSError, match="progress must be True or False"):
        gss.audit(model, reference, planted.tolist(), k=4, n=16, progress="no")
    with pytest.raises(GSSError, match="progress must be True or False"):
        gss.protect(model, reference, planted.tolist(), k=4, n=16, progress="no")


def test_calibrate_warns_when_gen_data_is_data(tmp_path, capsys):
    from gss.cli import main

    from ..helpers import word_tokenizer

    for name, seed in (("model", 0), ("reference", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        word_tokenizer().save_pretrained(tmp_path / name)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (tmp_path / "data.txt").write_text("\n".join(lines) + "\n")
    args = ["calibrate", "--model", str(tmp_path / "model"), "--reference"]
    args += [str(tmp_path / "reference"), "--data", str(tmp_path / "data.txt"), "--layer", "1"]
    args += [
        "--rank",
        "2",
        "--out",
        str(tmp_path / "art"),
        "--gen-data",
        str(tmp_path / "data.txt"),
    ]
    main(args)  # the CLI prints its warnings, one line each
    assert "is --data: the general statistics and the gates" in capsys.readouterr().err
    (tmp_path / "copy.txt").write_bytes((tmp_path / "data.txt").read_bytes())  # another path
    main([*args[:-1], str(tmp_path / "copy.txt"), "--overwrite"])
    assert "copy.txt is --data: the general statistics" in capsys.readouterr().err
