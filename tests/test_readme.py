"""The README's Python example runs as written (on tiny local models standing in for yours)."""

import json
import re
from pathlib import Path

from .conftest import tiny_model
from .test_cli import _tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    for name, seed in (("finetuned-model", 0), ("base-model", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        _tokenizer().save_pretrained(tmp_path / name)
    lines = [" ".join(f"w{(i * 5 + j) % 40}" for j in range(10)) for i in range(16)]
    (tmp_path / "finetune_data.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "README.md", "exec"), {})
    assert (tmp_path / "gss-artifact" / "gss_config.json").is_file()
    assert capsys.readouterr().out.strip()


def _section(title: str) -> str:
    text = README.read_text()
    assert title in text, f"README has no section {title!r}"
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def _table_rows(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("| ")][1:]  # after header


def test_readme_tinymem_table_is_the_committed_summary():
    """Every row of the README's TinyMem table is a row of results/tinymem/summary.md, which
    `gss bench tinymem` writes: the README cannot drift from what was measured."""
    summary = (README.parent / "results" / "tinymem" / "summary.md").read_text().splitlines()
    rows = _table_rows(_section("## Measured on TinyMem"))
    assert len(rows) >= 10
    assert [row for row in rows if row not in summary] == []


def test_readme_canary_table_is_the_committed_results():
    """The README's canary table quotes results/canaries/results.json (rounded as shown)."""
    results = json.loads((README.parent / "results" / "canaries" / "results.json").read_text())
    unmitigated = results["unmitigated"]["perplexity"]
    sources = {
        "base model": results["base_model"],
        "fine-tuned, unmitigated": results["unmitigated"],
        "GSS": results["methods"]["GSS"]["selected"],
        "GSS-TR": results["methods"]["GSS-TR"]["selected"],
        "mean-difference steering": results["methods"]["Mean-diff"]["selected"],
    }
    said = results["disclosure"]["models"]
    names = ["base model", "unmitigated", "GSS", "GSS-TR", "Mean-diff"]  # in the report
    said_by = dict(zip(sources, names, strict=True))
    rows = _table_rows(_section("## Measured on a real model"))
    assert [row.split(" | ")[0].strip("| ") for row in rows] == list(sources)
    for row in rows:
        cells = (cell.strip() for cell in row.strip("|").split("|"))
        name, selected, memorized, tokens, out, perplexity = cells
        got = sources[name]
        options = got.get("options", {})  # a method's selected point, as "delta 4, gate at p99"
        shown = [f"{key} {options[key]:g}" for key in ("delta", "alpha") if key in options]
        if options.get("threshold_percentile"):
            shown.append(f"gate at p{options['threshold_percentile']:g}")
        assert selected == ", ".join(shown), name
        assert memorized == f"{got['memorized']:.1f}" and tokens == f"{got['token_match']:.1f}"
        leaks = said[said_by[name]]
        assert out == f"{leaks['number_leaked']:.1f} / {leaks['address_leaked']:.1f}", name
        assert perplexity.split(" ")[0] == f"{got['perplexity']:.2f}", name
        if "(" in perplexity:  # the change against the unmitigated model's perplexity
            change = 100 * (got["perplexity"] / unmitigated - 1)
            assert perplexity.split(" ")[1] == f"({change:+.1f}%)", name


def test_readme_cpu_speed_rows_for_calibration_and_solve_are_the_committed_results():
    parts = json.loads((README.parent / "results" / "perf" / "results.json").read_text())["parts"]
    rows = {row.split(" | ")[0].strip("| "): row for row in _table_rows(_section("## Speed"))}
    calibration = rows["`gss.calibrate` / its unavoidable forward+backward passes"]
    assert calibration.split(" | ")[1] == f"{parts['calibration']['ratio']['median']:.2f}"
    solve = next(r for r in parts["solve"]["rows"] if r["d"] == 4096 and r["rank"] == 8)
    row = next(row for name, row in rows.items() if name.startswith("closed-form solve, d = 4096"))
    assert row.split(" | ")[1] == f"{solve['truncated']['median']:.2f} s"
    cosine = min(solve["steer_min_cos"], solve["probe_min_cos"])
    assert f"cos {cosine:.5f}" in row and f"takes {solve['full']['median']:.1f} s" in row
