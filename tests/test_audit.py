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
    from .helpers import tiny_model, word_tokenizer

    for name, seed in (("model", 0), ("ref", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        word_tokenizer().save_pretrained(tmp_path / name)
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
    # the attacker who asks another way: measured on the memorized rows, said in audit.md
    assert main([*args, "--other-prompts", "--overwrite"]) == 0
    summary = (tmp_path / "out" / "audit.md").read_text()
    assert "other prompts" in summary.lower()
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


def _cut_late(row: list[int]) -> list[int]:
    """``row`` with its 15th token changed: greedy decoding from its first 8 tokens no longer
    reproduces tokens 8..15, from its first 4 it still reproduces tokens 4..11."""
    return [*row[:14], 3 + (row[14] - 2) % 21, *row[15:]]


def test_a_row_extracted_only_from_a_shorter_prompt_is_found_with_prefixes(memorizer):
    """Issue 72: where the first k tokens already hold part of what is memorized, a shorter
    prompt extracts the row when k does not; the same forward says so, exact against greedy
    decoding from that prompt."""
    model, reference, planted, general = memorizer
    rows = [_cut_late(r) for r in planted.tolist()] + general[:6].tolist()
    k, n = 8, 16
    plain = gss.audit(model, reference, rows, k=k, n=n, progress=False)
    assert plain.prefixes == (8,)  # k = 8 has no halving down to the floor of 8
    assert not plain.memorized and not any(r.extracted_from for r in plain.rows[: len(planted)])
    scored = gss.audit(model, reference, rows, k=k, n=n, prefixes=[4], progress=False)
    assert scored.prefixes == (4, 8) and scored.memorized == []  # "k" stays the default
    found = scored.rows[: len(planted)]
    assert [r.extracted_from for r in found] == [(4,)] * len(planted)
    assert [r.leaks_from for r in found] == [4] * len(planted)
    assert not any(r.extractable for r in found)  # from k: not extractable
    for row in rows:  # exact: greedy decoding from the first 4 tokens
        (out,) = greedy_generate(model, [row[:4]], 8, pad_id=0)
        assert (out == row[4:12]) == (4 in scored.rows[rows.index(row)].extracted_from)
    assert scored.memorized_per_prefix() == {4: len(planted), 8: 0}
    assert "from prompts shorter than k" in scored.headline() and "6 from 4" in scored.headline()
    shortest = gss.audit(
        model, reference, rows, k=k, n=n, prefixes=[4], memorized_from="shortest", progress=False
    )
    assert [r.index for r in shortest.memorized] == list(range(len(planted)))
    assert shortest.window(shortest.rows[0]) == (4, 8)
    assert shortest.candidate(0) == (rows[0][:4], rows[0][4:12])  # measured on what leaks
    assert shortest.window(shortest.rows[-1]) == (8, 8)  # a clean row: the paper's window
    assert "from the shortest prompt of 4 and 8 tokens" in shortest.headline()


def test_audit_reports_which_part_of_each_row_was_scored(memorizer, tmp_path):
    """The table and audit.jsonl say where each row's prompt ends and its window starts, with
    the text either side when the audit had the tokenizer."""
    from .helpers import WORDS, word_tokenizer

    model, reference, planted, _ = memorizer
    rows = [_cut_late(r) for r in planted.tolist()]
    tok = word_tokenizer(WORDS[:24])  # the memorizer's 24 ids
    report = gss.audit(
        model, reference, rows, tokenizer=tok, k=8, n=16, prefixes=[4],
        memorized_from="shortest", progress=False,
    )  # fmt: skip
    assert "| 0-3 / 4-11 |" in report.table() and "| 4 |" in report.table()
    prompt_end = tok.decode(rows[0][:4]).split()[-1]
    assert f"{prompt_end} ‖ {tok.decode(rows[0][4:12]).split()[0]}" in report.table()
    report.write(tmp_path / "audit")
    first = json.loads((tmp_path / "audit" / "audit.jsonl").read_text().splitlines()[0])
    assert (first["prompt_tokens"], first["window_tokens"]) == (4, 8)
    assert first["prompt_text"] == tok.decode(rows[0][:4])
    assert first["window_text"] == tok.decode(rows[0][4:12])
    assert first["extracted_from"] == [4] and first["reference_extracted_from"] == []
    md = (tmp_path / "audit" / "audit.md").read_text()
    assert md.startswith("6 of 6 rows extractable, 6 of them not by the reference (from the ")


def test_prefix_windows_shorter_than_the_minimum_are_not_counted(memorizer):
    """A window of a few tokens is a weak finding (issue 72 saw clean passages flagged from
    7-13): a prompt's window counts with `MIN_WINDOW` tokens, or all of n - k."""
    from gss.audit import MIN_WINDOW

    model, reference, planted, _ = memorizer
    rows = [r[:11] for r in planted.tolist()]  # 3 tokens after k = 8; 7 after 4
    report = gss.audit(model, reference, rows, k=8, n=16, prefixes=[4], progress=False)
    assert MIN_WINDOW > 8 and all(r.extractable for r in report.rows)  # k's rule: to the end
    assert not any(r.extracted_from for r in report.rows)  # 3 or 7 of 8 tokens: not counted
    shortest = gss.audit(
        model, reference, rows, k=8, n=16, prefixes=[4], memorized_from="shortest", progress=False
    )
    assert shortest.memorized == [] and shortest.summary()["checkable"] == 0


def test_audit_refuses_prefixes_it_cannot_score(memorizer):
    model, reference, planted, _ = memorizer
    rows = planted.tolist()
    for prefixes, message in [
        ([], "prefixes must be a list"),
        ("8", "prefixes must be a list"),
        ([0], "from 1 to 4 "),
        ([5], "from 1 to 4 "),  # n = 16, k = 4: 12 tokens must follow
        ([2.5], "whole numbers"),
        ([True], "whole numbers"),
    ]:
        with pytest.raises(GSSError, match=message):
            gss.audit(model, reference, rows, k=4, n=16, prefixes=prefixes, progress=False)
    with pytest.raises(GSSError, match="memorized_from must be one of k, shortest"):
        gss.audit(model, reference, rows, k=4, n=16, memorized_from="any", progress=False)
    assert gss.audit(model, reference, rows, k=4, n=16, prefixes=[2, 2]).prefixes == (2, 4)


def test_default_prefixes_halve_k_down_to_the_floor():
    from gss.audit import default_prefixes

    assert default_prefixes(32) == (8, 16, 32)
    assert default_prefixes(96) == (12, 24, 48, 96)
    assert default_prefixes(4) == (4,)


def test_an_older_audit_jsonl_still_loads(memorizer, tmp_path):
    """audit.jsonl keeps its keys; a row written before the prompts were scored loads with
    the new fields at their defaults, and a new row loads back as it was."""
    from gss.audit import AuditRow

    old = {
        "index": 2, "tokens": 16, "extractable": True, "matched": 1.0, "longest_run": 15,
        "omega_mean": 1.5, "omega_max": 3.0, "omega_burst": 12, "reference_extractable": False,
        "row": 2, "text": "w1 w2", "window_tokens": 12,
    }  # fmt: skip
    row = AuditRow.from_json(old)
    assert row.memorized and row.extracted_from == () and row.leaks_from is None
    model, reference, planted, _ = memorizer
    report = gss.audit(model, reference, planted.tolist(), k=8, n=16, prefixes=[4])
    report.write(tmp_path / "audit")
    lines = (tmp_path / "audit" / "audit.jsonl").read_text().splitlines()
    assert set(old) - {"text"} <= set(json.loads(lines[0]))  # the old keys are all there
    assert [AuditRow.from_json(json.loads(line)) for line in lines] == report.rows
    assert report.rows[0].extracted_from == (4, 8)


def test_audit_command_scores_shorter_prompts(memorizer, tmp_path, capsys):
    """--prefixes and --memorized-from, and a bad list refused in one line before the models
    load (the model directories here do not exist)."""
    from .helpers import WORDS, word_tokenizer

    args = ["audit", "--model", str(tmp_path / "none"), "--reference", str(tmp_path / "nor")]
    args += ["--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "out")]
    for given, message in [
        (["--prefixes", "8,x"], "--prefixes takes comma-separated prompt lengths"),
        (["--prefixes", "0,8"], "--prefixes: prefixes must be whole numbers of prompt tokens "),
        (["--prefixes", "60"], "from 1 to 56 (a window of 16 tokens before n = 72)"),
        (["--prefixes", "8", "--reply"], "--prefixes scores plain rows"),
    ]:
        assert main([*args, *given]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    model, reference, planted, _ = memorizer
    for name, m in (("none", model), ("nor", reference)):
        m.save_pretrained(tmp_path / name)
        word_tokenizer(WORDS[:24]).save_pretrained(tmp_path / name)
    rows = [_cut_late(r) for r in planted.tolist()]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    window = ["--k", "8", "--n", "16", "--prefixes", "4", "--no-progress"]
    assert main([*args, *window, "--memorized-from", "shortest"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("6 of 6 rows extractable, 6 of them not by the reference (from")
    assert "| 0-3 / 4-11 |" in printed
    memorized = read_texts(tmp_path / "out" / "memorized.jsonl", keep_rows=True)
    assert [row["input_ids"] for row in memorized] == rows


def test_clean_rows_leave_out_every_mode_of_memorization():
    """protect's domain rows (`clean_ids`) are the rows no measured mode finds memorized: a row
    the greedy audit missed but the sampler reproduces, or most of whose window is predicted
    near-verbatim, is not clean (a TinyMem backdoor's two such rows refused every steer)."""
    from math import log

    from gss.audit import AuditReport, AuditRow

    sure, unlikely = log(0.9), log(1e-6)  # one sample's chance of the whole window

    def row(index: int, **fields) -> AuditRow:
        base = dict(tokens=12, extractable=False, matched=0.1, longest_run=1, omega_mean=0.0)
        base.update(omega_max=0.0, omega_burst=0, reference_extractable=False)
        base.update(sampled_logprob=unlikely, nucleus_logprob=unlikely)
        base.update(reference_sampled_logprob=unlikely)
        base.update(fields)
        return AuditRow(index=index, **base)

    rows = [
        row(0),  # clean
        row(1, extractable=True),  # memorized greedily
        row(2, sampled_logprob=sure),  # the sampler says it
        row(3, nucleus_logprob=sure),  # top-p says it
        row(4, matched=0.85),  # near-verbatim, teacher-forced
        row(5, extractable=True, reference_extractable=True),  # any model completes it
        row(6, sampled_logprob=sure, reference_sampled_logprob=sure),  # the reference too
        row(7, extracted_from=(4,)),  # a shorter prompt extracts it
    ]
    ids = [[i] * 12 for i in range(len(rows))]
    report = AuditReport(rows=rows, k=4, n=12, seconds=0.0, ids=ids, prefixes=(4, 8))
    assert [r.index for r in rows if report.shows_memorization(r)] == [1, 2, 3, 4, 7]
    assert report.clean_ids == [ids[0], ids[5], ids[6]]
    assert [r.index for r in report.memorized] == [1]  # what protect tunes on is unchanged
