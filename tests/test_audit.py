"""gss audit: which rows a fine-tune reproduces, exact against greedy generation."""

from __future__ import annotations

import json

import pytest
import torch

import gss
from gss import GSSError
from gss.cli import main
from gss.data import read_texts
from gss.evaluate.decoding import greedy_generate


def _longest_greedy_run(model, row: list[int]) -> int:
    """The longest stretch greedy decoding reproduces from some prefix of ``row``, by
    decoding from every prefix (what the audit reads off one teacher-forced pass)."""
    best = 0
    for start in range(1, len(row)):
        (out,) = greedy_generate(model, [row[:start]], len(row) - start, pad_id=0)
        run = 0
        for got, want in zip(out, row[start:], strict=True):
            if got != want:
                break
            run += 1
        best = max(best, run)
    return best


def test_audit_agrees_with_greedy_generation(memorizer):
    model, reference, planted, general = memorizer
    rows = torch.cat([planted, general[:10]]).tolist()
    k, n = 4, 16
    report = gss.audit(model, reference, rows, k=k, n=n, batch_size=5, progress=False)
    assert [r.index for r in report.rows] == list(range(len(rows)))
    greedy = greedy_generate(model, [r[:k] for r in rows], n - k, pad_id=0)
    for row, found, decoded in zip(rows, report.rows, greedy, strict=True):
        assert found.extractable == (decoded == row[k:n])  # exact, no generation needed
        assert (
            found.matched
            == pytest.approx(sum(a == b for a, b in zip(decoded, row[k:n], strict=True)) / (n - k))
            or not found.extractable
        )  # matched is teacher-forced: equal where all match
    for row, found in list(zip(rows, report.rows, strict=True))[:3]:
        assert found.longest_run == _longest_greedy_run(model, row)
    planted_rows = report.rows[: len(planted)]
    assert all(r.extractable for r in planted_rows)  # the memorizer learned them by heart
    general_omega = [r.omega_mean for r in report.rows[len(planted) :]]
    assert min(r.omega_mean for r in planted_rows) > max(general_omega)  # the risk score
    assert report.summary()["extractable"] == len(report.extractable)
    assert report.ranked()[0].extractable


def test_audit_writes_what_evaluate_reads(memorizer, tmp_path):
    model, reference, planted, _ = memorizer
    report = gss.audit(model, reference, planted.tolist(), k=4, n=16, progress=False)
    with pytest.raises(GSSError, match="is empty"):  # not the working directory
        report.write("")
    written = report.write(tmp_path / "audit")
    assert [p.name for p in written] == [
        "audit.jsonl",
        "audit.md",
        "memorized.jsonl",
        "extractable.jsonl",
        "audit.png",
    ]
    assert written[-1].stat().st_size > 1000  # the histograms
    lines = (tmp_path / "audit" / "audit.jsonl").read_text().splitlines()
    assert len(lines) == len(planted) and json.loads(lines[0])["extractable"] is True
    assert {json.loads(line)["window_tokens"] for line in lines} == {16 - 4}
    kept = read_texts(tmp_path / "audit" / "extractable.jsonl", keep_rows=True)
    assert [row["input_ids"] for row in kept] == planted.tolist()
    memorized = read_texts(tmp_path / "audit" / "memorized.jsonl", keep_rows=True)
    assert [row["input_ids"] for row in memorized] == [
        report.ids[r.index] for r in report.memorized
    ]
    assert report.memorized  # the planted rows: the reference does not extract them
    assert "rows extractable" in (tmp_path / "audit" / "audit.md").read_text()


def test_audit_refuses_a_window_it_cannot_read(memorizer):
    model, reference, planted, _ = memorizer
    with pytest.raises(gss.GSSError, match="n must be an integer > k"):
        gss.audit(model, reference, planted.tolist(), k=8, n=8)
    with pytest.raises(gss.GSSError, match="k must be an integer >= 1"):
        gss.audit(model, reference, planted.tolist(), k=0)


def test_audit_command(tmp_path, capsys):
    from .helpers import tiny_model
    from .test_cli import _tokenizer

    for name, seed in (("model", 0), ("ref", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        _tokenizer().save_pretrained(tmp_path / name)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(6)]
    (tmp_path / "data.txt").write_text("\n".join(lines) + "\n")
    args = ["audit", "--model", str(tmp_path / "model"), "--reference", str(tmp_path / "ref")]
    args += ["--data", str(tmp_path / "data.txt"), "--k", "4", "--n", "12"]
    args += ["--out", str(tmp_path / "out"), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "of them not by the reference ((12,4)-extraction, 6 rows" in printed
    assert (tmp_path / "out" / "extractable.jsonl").is_file()
    assert main(args) == 2  # results there: not replaced without --overwrite
    assert "pass --overwrite" in capsys.readouterr().err
    rows = [{"prompt": " ".join(line.split()[:5]), "completion": " " + line} for line in lines]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args[args.index(str(tmp_path / "data.txt"))] = str(tmp_path / "chat.jsonl")
    assert main([*args, "--reply", "--overwrite"]) == 0  # each completion given its prompt
    audited = (tmp_path / "out" / "audit.jsonl").read_text().splitlines()
    assert len(audited) == 6 and all(json.loads(r)["tokens"] == 5 + 8 for r in audited)
    assert all(json.loads(r)["window_tokens"] == 8 for r in audited)  # the reply's 12 - 4
    # a one-word line (nothing to predict: not audited) and a blank one before the rest: each
    # row still names its line, and shows its text
    (tmp_path / "data.txt").write_text("w1\n\n" + "\n".join(lines) + "\n")
    args[args.index(str(tmp_path / "chat.jsonl"))] = str(tmp_path / "data.txt")
    assert main([*args, "--overwrite"]) == 0
    audited = [json.loads(r) for r in (tmp_path / "out" / "audit.jsonl").read_text().splitlines()]
    assert [(r["index"], r["row"]) for r in audited] == [(i, i + 1) for i in range(6)]
    assert [r["source"] for r in audited] == [f"{tmp_path / 'data.txt'}:{i + 3}" for i in range(6)]
    assert [r["text"] for r in audited] == lines
    assert "data.txt:3 | " in (tmp_path / "out" / "audit.md").read_text()


def test_audit_shows_how_many_tokens_each_row_was_checked_on(memorizer):
    """A row barely longer than k is checked on a few tokens only (a weak finding): the
    table and the JSONL say how many."""
    model, reference, planted, _ = memorizer
    rows = [planted[0].tolist()[:6], planted[1].tolist()[:16], planted[2].tolist()[:3]]
    report = gss.audit(model, reference, rows, k=4, n=16, progress=False)
    assert [report.window_tokens(r) for r in report.rows] == [2, 12, 0]
    assert report.rows[2].extractable is None  # no more than k tokens: nothing to check
    table = report.table()
    assert "| window tokens |" in table
    assert "| 2 |" in table and "| 12 |" in table


def test_audit_reads_replies_given_their_prompt(memorizer):
    """(prompt, reply) pairs, as chats give: extractable iff greedy decoding from the whole
    prompt reproduces the reply's first n - k tokens."""
    model, reference, planted, general = memorizer
    rows = torch.cat([planted, general[:6]]).tolist()
    pairs = [(r[: 5 + i % 3], r[5 + i % 3 :]) for i, r in enumerate(rows)]  # prompts of 5-7
    report = gss.audit(model, reference, pairs, k=4, n=12, batch_size=4, progress=False)
    greedy = [greedy_generate(model, [p], 8, pad_id=0)[0] for p, _ in pairs]
    for (prompt, reply), found, decoded in zip(pairs, report.rows, greedy, strict=True):
        assert found.extractable == (decoded == reply[:8])
        assert report.candidate(found.index) == (prompt, reply[:8])
    assert all(r.extractable for r in report.rows[: len(planted)])
    assert not any(r.reference_extractable for r in report.rows[: len(planted)])
    assert [r.index for r in report.memorized] == list(range(len(planted)))
