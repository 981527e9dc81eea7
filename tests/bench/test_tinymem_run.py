"""`gss bench tinymem --quick` end to end: trains tiny models, runs every method, writes files."""

import json

import pytest

from gss.bench.tinymem.run import main


@pytest.mark.parametrize("setting", ["math_noise", "math_backdoor"])
def test_quick_benchmark_writes_table_json_and_figures(tmp_path, setting, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "--quick",
            "--settings",
            setting,
            "--deltas",
            "0.01,0.1,1",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-progress",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    (run,) = results["runs"]
    assert set(run["methods"]) == {"GSS", "GSS ungated", "Mean-diff", "GSS-TR", "GSS-TR ungated"}
    for method in run["methods"].values():
        assert method["grid"] and "eval" in method["selected"]
    assert run["unmitigated"]["rows"] > 0
    timings = run["calibration"]["paper"]["timings"]
    assert {"signal", "statistics", "solve", "thresholds"} <= set(timings)
    table = (out / "table.md").read_text()
    assert "| GSS |" in table and "paper" in table
    assert (out / f"pareto_{setting}.png").stat().st_size > 1000
    assert (out / f"signal_{setting}_seed0.png").stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out


def test_results_of_other_settings_are_kept_and_reruns_replace_them():
    from gss.bench.tinymem.run import merge_runs

    def run(setting, seed, tag):
        return {"setting": setting, "seed": seed, "preset": "default", "tag": tag}

    previous = [
        run("lang_noise", 0, "old"),
        run("math_noise", 0, "old"),
        run("math_noise", 1, "old"),
    ]
    merged = merge_runs(previous, [run("math_noise", 0, "new")])
    assert [(r["setting"], r["seed"], r["tag"]) for r in merged] == [
        ("math_noise", 0, "new"),
        ("math_noise", 1, "old"),
        ("lang_noise", 0, "old"),
    ]
