"""A benchmark rerun replaces the protect report it wrote before (a committed folder carries no
record of gss's writes), and refuses, before any work, a report folder holding anything else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gss.errors import GSSError
from gss_bench.protect_report import check_report_dir, write_report


class _Result:
    """What `write_report` needs of a `gss.Protection`: ``write(directory)``, which, as the
    real one, refuses to replace files it has no record of writing."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def write(self, directory: Path) -> None:
        assert not directory.exists(), "the new report goes into a folder of its own"
        (directory / "steer").mkdir(parents=True)
        (directory / "protect.json").write_text(json.dumps({"run": self.tag}))
        (directory / "steer" / "gss_config.json").write_text("{}")


def test_a_rerun_replaces_the_benchmarks_own_report(tmp_path):
    report = tmp_path / "protect"
    write_report(_Result("first"), report)
    (report / "rows.png").write_bytes(b"old figure")  # as a committed report holds
    write_report(_Result("second"), report)
    assert json.loads((report / "protect.json").read_text()) == {"run": "second"}
    assert not (report / "rows.png").exists()  # the old report went whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["protect"]  # no .partial left


def test_a_folder_holding_anything_else_is_refused_before_any_work(tmp_path):
    report = tmp_path / "protect"
    report.mkdir()
    (report / "notes.txt").write_text("mine")
    with pytest.raises(GSSError, match=r"notes\.txt, which a protect report does not"):
        check_report_dir(report)
    with pytest.raises(GSSError, match=r"notes\.txt"):
        write_report(_Result("x"), report)
    assert (report / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(GSSError, match="not a folder of its own"):
        check_report_dir(tmp_path / "file")
    check_report_dir(tmp_path / "absent")  # nothing there yet: fine


@pytest.mark.parametrize("bench", ["canaries", "tinymem"])
def test_the_benchmarks_check_the_report_folder_before_any_work(tmp_path, bench, monkeypatch):
    if bench == "canaries":
        from gss_bench.canaries.run import main

        report, argv = tmp_path / "protect", ["--protect", "--out", str(tmp_path)]
    else:
        from gss_bench.tinymem.run import main

        report = tmp_path / "protect_math_noise_seed0"
        argv = ["--settings", "math_noise", "--seeds", "0", "--methods", "GSS protect"]
        argv += ["--out", str(tmp_path), "--fresh"]
    report.mkdir()
    (report / "notes.txt").write_text("mine")
    with pytest.raises(GSSError, match=r"notes\.txt"):
        main(argv)
    assert (report / "notes.txt").read_text() == "mine"
