"""The docs run and quote what was measured.

docs/your-model.md's Python example runs as written (on tiny local models standing in for the
user's fine-tune and its base), and the measured tables that moved out of the README
(docs/results.md, the calibration and solve rows of docs/scaling.md, the table of the vLLM
runner patch's host work that moved from docs/serving.md to results/serve-fill-slots/README.md)
are checked against the committed results/: a changed digit on either side fails. Every
relative link of the docs, READMEs and changelog leads to a file that exists, and to a heading
of it where it names one. The docs together stay under 200 KB (issue 71).
"""

import json
import re
from pathlib import Path

from .helpers import tiny_model, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "results"
GUIDE = DOCS / "your-model.md"


def section(path: Path, title: str) -> str:
    """The text of the section of ``path`` that starts with ``title`` (a heading or a bold
    lead-in), up to the next level-2 heading."""
    text = path.read_text()
    assert title in text, f"{path.name} has no section {title!r}"
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def table_rows(text: str) -> list[str]:
    """The body rows of the first Markdown table in ``text`` (header and rule left out)."""
    rows: list[str] = []
    for line in text.splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break  # the table ended
    return rows[2:]


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def test_your_model_python_example_runs(tmp_path, monkeypatch, capsys):
    block = re.search(r"```python\n(.*?)```", section(GUIDE, "## In Python"), re.S)
    assert block is not None
    for name, seed in (("ft", 0), ("base", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        word_tokenizer().save_pretrained(tmp_path / name)

    def lines(offset: int) -> str:  # rows longer than k = 32 tokens, so they can be prompted
        rows = [" ".join(f"w{(i * 7 + j * offset) % 40}" for j in range(40)) for i in range(12)]
        return "\n".join(rows) + "\n"

    (tmp_path / "candidates.txt").write_text(lines(3))
    (tmp_path / "heldout.txt").write_text(lines(5))
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "your-model.md", "exec"), {})
    assert (tmp_path / "gss-artifact" / "gss_config.json").is_file()
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) >= 2, printed  # before/after, then at least one point of the front


def test_results_tinymem_table_is_the_committed_summary():
    """Every row of docs/results.md's TinyMem table is a row of results/tinymem/summary.md,
    which `gss bench tinymem` writes: the page cannot drift from what was measured."""
    summary = (RESULTS / "tinymem" / "summary.md").read_text().splitlines()
    rows = table_rows(section(DOCS / "results.md", "## Measured on TinyMem"))
    assert len(rows) >= 10
    assert [row for row in rows if row not in summary] == []


def test_results_canary_table_is_the_committed_results():
    """docs/results.md's canary table quotes results/canaries/results.json (rounded as shown)."""
    results = json.loads((RESULTS / "canaries" / "results.json").read_text())
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
    rows = table_rows(section(DOCS / "results.md", "## Measured on a real model"))
    assert [cells(row)[0] for row in rows] == list(sources)
    for row in rows:
        name, selected, memorized, tokens, out, perplexity = cells(row)
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


def _scaling_rows(lead_in: str) -> dict[str, str]:
    """The rows of the first table after ``lead_in`` in docs/scaling.md, by their first cell."""
    return {cells(row)[0]: row for row in table_rows(section(DOCS / "scaling.md", lead_in))}


def _check_calibration_and_solve(rows: dict[str, str], results: str) -> None:
    parts = json.loads((RESULTS / results / "results.json").read_text())["parts"]
    calibration = next(r for n, r in rows.items() if n.startswith("`gss.calibrate` / its"))
    ratio = parts["calibration"]["ratio"]
    quoted = f"{ratio['median']:.3f} (IQR {ratio['q1']:.3f}-{ratio['q3']:.3f})"
    assert cells(calibration)[1] == quoted, calibration
    solve = next(r for r in parts["solve"]["rows"] if r["d"] == 4096 and r["rank"] == 8)
    row = next(r for n, r in rows.items() if n.startswith("`solve_probe_steer`, d = 4096, K = 8"))
    measured = cells(row)[1]
    assert f"{solve['truncated']['median']:.2f} s" in measured or (
        f"{solve['truncated']['median']:.3f} s" in measured
    ), row
    assert f"{solve['power_iters']} iterations" in measured, row
    assert f"{solve['full']['median']:.1f} s" in measured or (
        f"{solve['full']['median']:.2f} s" in measured
    ), row
    cosine = min(solve["steer_min_cos"], solve["probe_min_cos"])
    assert f"cos {cosine:.5f}" in measured, row


def test_scaling_cpu_calibration_and_solve_rows_are_the_committed_results():
    """The CPU table's calibration and solve rows quote results/perf/results.json."""
    _check_calibration_and_solve(_scaling_rows("**Measured on this 2-core CPU**"), "perf")


def test_scaling_h100_calibration_and_solve_rows_are_the_committed_results():
    """The H100 table's calibration and solve rows quote results/perf-cuda/results.json."""
    _check_calibration_and_solve(_scaling_rows("**Measured on one NVIDIA H100"), "perf-cuda")


def test_serving_fill_table_is_the_committed_results():
    """results/serve-fill-slots/README.md's table of the runner patch's per-step host work
    (moved there from docs/serving.md) quotes the JSON files beside it (the run now and the runs
    of the code before each change)."""
    folder = RESULTS / "serve-fill-slots"

    def by_shape(name: str) -> dict[str, dict]:
        rows = json.loads((folder / name).read_text())["shapes"]
        return {f"{r['sequences']} x {r['tokens_each']}": r for r in rows}

    now = by_shape("results.json")
    shortcut_before = by_shape("before-cd8c728.json")
    v2_before = [by_shape(f"before-4aeadc1-run{i}.json") for i in (1, 2)]
    v1_before = [by_shape(f"before-8930497-run{i}.json") for i in (1, 2)]
    rows = table_rows(section(folder / "README.md", "`benchmarks/scripts/vllm_fill_slots.py`"))
    assert rows, "no table"
    for row in rows:
        shape, first, written, unchanged, v2, v2_unchanged, steady_old, v2_old, v1_old = cells(row)
        r, b = now[shape], shortcut_before[shape]
        keys = ("first_step_us", "later_step_us", "steady_step_us", "v2_step_us", "v2_steady_us")
        assert [first, written, unchanged, v2, v2_unchanged] == [f"{r[k]:.1f}" for k in keys]
        assert steady_old == f"{b['steady_step_us']:.1f} / {b['v2_steady_us']:.1f}"
        assert v2_old == " / ".join(f"{b[shape]['v2_step_us']:.1f}" for b in v2_before)
        assert v1_old == " / ".join(f"{b[shape]['later_step_us']:.1f}" for b in v1_before)


def test_docs_stay_under_200_kb():
    """docs/*.md together stay under 200 KB (issue 71): the docs describe the software as it is,
    with its headline numbers and a link to where they were measured; the measurement diaries
    (run-by-run narratives, how a default was arrived at, superseded comparisons) live next to
    their data, in results/<study>/README.md."""
    sizes = {path.name: path.stat().st_size for path in DOCS.glob("*.md")}
    assert len(sizes) > 10
    assert sum(sizes.values()) < 200_000, sorted(sizes.items(), key=lambda item: -item[1])


LINKED_DOCS = ["README.md", "CHANGELOG.md", "docs/*.md", "results/**/README.md"]
LINKED_DOCS += ["benchmarks/**/*.md", "tests/vllm/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, spaces to '-', punctuation but '-' and '_'
    dropped (inline code and link markup go too)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading's get -1, -2, ...)."""
    found: set[str] = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        base = slug(heading)
        name, i = base, 0
        while name in found:
            i += 1
            name = f"{base}-{i}"
        found.add(name)
    return found


def test_relative_links_and_anchors_resolve():
    """Every relative link of the docs, READMEs and changelog names a file that exists, and an
    anchor there names one of its headings (external URLs are not checked)."""
    files = sorted({p for pattern in LINKED_DOCS for p in ROOT.glob(pattern) if p.is_file()})
    assert len(files) > 20
    cache: dict[Path, set[str]] = {}
    broken = []
    for path in files:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)  # a link inside inline code is no link
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {file}")
            elif anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
