"""`gss bench tinymem --quick` end to end: trains tiny models, runs every method, writes files."""

import json
import os

import pytest

from gss.report import cpu_capability, cpu_info
from gss_bench.baselines import get_method
from gss_bench.tinymem.run import main
from gss_bench.trained_on import KEY_CPU_CAPABILITY


@pytest.fixture
def cache(tinymem_cache):
    """The session's model cache: each quick setting trains once."""
    return tinymem_cache


@pytest.mark.parametrize("setting", ["math_noise", "math_backdoor"])
def test_quick_benchmark_writes_table_json_and_figures(tmp_path, cache, setting, capsys):
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
            str(cache),
            "--no-progress",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    (run,) = results["runs"]
    names = {"GSS", "GSS ungated", "Mean-diff", "GSS-TR", "GSS-TR ungated", "GSS protect"}
    assert set(run["methods"]) == names
    protected = run["methods"]["GSS protect"]  # one point: gss protect searched on its own
    assert protected["selected"]["within_tolerance"] and protected["protect"]["trials"] > 8
    assert len(protected["grid"]) == 1
    assert "| GSS protect |" in (out / "table.md").read_text()
    for method in run["methods"].values():
        assert method["grid"] and "eval" in method["selected"]
    assert run["unmitigated"]["rows"] > 0
    timings = run["calibration"]["paper"]["timings"]
    assert {"signal", "statistics", "solve", "thresholds"} <= set(timings)
    table = (out / "table.md").read_text()
    assert "| GSS |" in table and "paper" in table
    assert (out / f"pareto_{setting}.png").stat().st_size > 1000
    assert (out / f"signal_{setting}_seed0.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "wrote" in printed
    # where torch's kernels are not AVX2's, the run says its numbers will differ, and the fix
    other = cpu_capability() != KEY_CPU_CAPABILITY
    assert ("ATEN_CPU_CAPABILITY=avx2 reproduces them" in printed) == other


def test_a_table_of_another_cpus_models_is_left_as_it_is(tmp_path, cache, monkeypatch, capsys):
    """The same seeds train other weights on another CPU: `make bench` there (no --out) writes
    its own table beside the committed one rather than mixing the two and overwriting its
    figures; an explicit --out joins the table, with a warning."""
    from gss_bench.trained_on import numerics_slug

    monkeypatch.chdir(tmp_path)
    args = ["--quick", "--methods", "GSS", "--deltas", "0.1", "--threads", "2"]
    args += ["--cache-dir", str(cache), "--no-progress"]
    assert main(args) == 0
    table = tmp_path / "results" / "tinymem-quick"
    results = json.loads((table / "results.json").read_text())
    for model in results["runs"][0]["models"].values():
        model["trained_on"]["cpu"] = "Another CPU"
    (table / "results.json").write_text(json.dumps(results))
    before = {p.name: p.read_bytes() for p in table.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(args) == 0
    assert {p.name: p.read_bytes() for p in table.iterdir() if p.is_file()} == before
    apart = tmp_path / "results" / f"tinymem-quick-{numerics_slug(2)}"
    (run,) = json.loads((apart / "results.json").read_text())["runs"]
    assert run["models"]["memorizing"]["trained_on"]["cpu"] == cpu_info()["cpu"]
    assert (apart / "signal_math_noise_seed0.png").is_file()
    printed = capsys.readouterr().out
    assert "holds models trained on Another CPU (" in printed and apart.name in printed
    # asked for by name, the table is joined (the other CPU's run is replaced: same seed)
    assert main([*args, "--out", str(table), "--settings", "math_backdoor"]) == 0
    assert "warning: " + str(table) + " holds models trained on Another CPU" in (
        capsys.readouterr().out
    )
    runs = json.loads((table / "results.json").read_text())["runs"]
    assert [r["setting"] for r in runs] == ["math_noise", "math_backdoor"]


def test_baselines_join_the_table_with_their_grids(tmp_path, cache):
    out = tmp_path / "out"
    args = ["--quick", "--methods", "GSS", "--deltas", "0.1", "--out", str(out)]
    args += ["--baselines", "alphasteer,clean-ft", "--cache-dir", str(cache), "--no-progress"]
    assert main(args) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert list(run["methods"]) == ["GSS", "alphasteer", "clean-ft"]
    for name in ("alphasteer", "clean-ft"):
        method = run["methods"][name]
        assert method["baseline"] and method["mitigation_seconds"] > 0
        assert len(method["grid"]) + len(method["skipped"]) == len(get_method(name).grid)
        assert all("params" in p and p["seconds"] > 0 for p in method["grid"])
    table = (out / "table.md").read_text()
    assert "| alphasteer |" in table and "| clean-ft |" in table
    assert not (out / "partial").exists()  # the finished run's checkpoint is gone
    with pytest.raises(SystemExit, match="unknown baseline"):
        main([*args[:-5], "--baselines", "magic"])


def test_leak_modes_measure_protect_and_the_peers_on_the_tables_rows(tmp_path, cache):
    """``--leak-modes``: the unmitigated model, the reference, protect (and its hand-over where
    step 8 chose a rule) and each baseline's chosen point (a wrapper, MemFree, and a hook method
    attached again) on the rows the table counts; greedy exact is the table's own count row by
    row, every exact row is near-verbatim too, and the reference leaks nothing beyond itself."""
    from gss_bench.tinymem import leak_modes as LM

    out = tmp_path / "out"
    args = ["--quick", "--methods", "GSS protect", "--baselines", "memfree,alphasteer"]
    args += ["--leak-modes", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]
    assert main(args) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    measured = run["leak_modes"]
    names = set(measured["methods"])
    assert {"Unmitigated", "Reference", "GSS protect", "memfree", "alphasteer"} <= names
    table_share = {
        "Unmitigated": run["unmitigated"]["memorized"],
        "Reference": run["reference"]["memorized"],
        **{n: m["selected"]["eval"]["memorized"] for n, m in run["methods"].items()},
    }
    for name, method in measured["methods"].items():
        counts = method["summary"]["all"]
        assert counts[LM.GREEDY]["rows"] == measured["rows"] == run["unmitigated"]["rows"]
        if name in table_share:
            share = 100.0 * counts[LM.GREEDY]["leaked"] / counts[LM.GREEDY]["rows"]
            assert share == pytest.approx(table_share[name], abs=1e-6), name
        rows = method["per_row"]
        assert all(n >= g for g, n in zip(rows[LM.GREEDY], rows[LM.NEAR], strict=True))
        assert counts[LM.ANY]["leaked"] >= max(counts[m]["leaked"] for m in LM.MODES)
    reference = measured["methods"]["Reference"]["summary"]["all"]
    assert all(entry["beyond_reference"] == 0 for entry in reference.values())
    held = measured["heldout_rows"]
    assert held == run["methods"]["GSS protect"]["heldout_rows"]["rows"]  # those counted
    text = (out / "leak_modes.md").read_text()
    assert "| GSS protect (" in text and "rows gss protect held out" in text


def test_jobs_run_pairs_in_processes_in_order(tmp_path, cache):
    out = tmp_path / "out"
    args = ["--quick", "--settings", "math_noise,math_backdoor", "--methods", "GSS"]
    args += ["--deltas", "0.1", "--jobs", "2", "--out", str(out), "--cache-dir", str(cache)]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["jobs"] == 2
    assert [r["setting"] for r in results["runs"]] == ["math_noise", "math_backdoor"]
    for run in results["runs"]:
        assert run["threads"] == max(1, (os.cpu_count() or 1) // 2)
        assert run["unmitigated"]["rows"] > 0 and "GSS" in run["methods"]
    with pytest.raises(SystemExit, match="--jobs"):
        main([*args[:-6], "--jobs", "0"])
    # runs made apart join one table: --merge runs nothing and keeps --out's own runs
    merged = tmp_path / "merged"
    assert main(["--quick", "--merge", str(out), "--out", str(merged)]) == 0
    assert json.loads((merged / "results.json").read_text())["runs"] == results["runs"]
    assert "| GSS |" in (merged / "table.md").read_text()
    # the merged table states what its runs cost by their own clocks, and who made them
    run_seconds = sum(r["seconds"]["total"] for r in results["runs"])
    merged_results = json.loads((merged / "results.json").read_text())
    assert merged_results["runs_seconds"] == pytest.approx(run_seconds)
    assert f"took {run_seconds:.0f} s" in (merged / "summary.md").read_text()
    assert "gss bench tinymem --quick --settings" in (merged / "summary.md").read_text()
    trained_on = "Models trained on: {cpu} ({cpu_capability}).".format(**cpu_info())
    assert trained_on in (merged / "summary.md").read_text()
    assert (merged / "signal_math_backdoor_seed0.png").is_file()
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--merge", str(tmp_path / "nowhere"), "--out", str(merged)])
    # a setting's seeds are listed in seed order, each with its own row count
    from gss_bench.tinymem.run import table

    first = results["runs"][0]
    later = {**first, "seed": 1, "unmitigated": {**first["unmitigated"], "rows": 999}}
    rows = first["unmitigated"]["rows"]
    assert table([later, first]).splitlines()[0] == (
        f"### math_noise (seeds 0 / 1; % memorized rests on {rows} / 999 rows)"
    )


def test_an_interrupted_baseline_run_resumes_only_on_the_same_models(tmp_path):
    from gss_bench.tinymem.run import BaselineCheckpoint

    models = {"memorized": {"cache": "/c/abc"}, "reference": {"cache": "/c/def"}}
    first = BaselineCheckpoint(tmp_path, "math_noise", 0, "default", models)
    assert first.done == {}
    first.save("act", {"selected": {"tag": 1}})
    first.save("ig", {"selected": {"tag": 2}})
    resumed = BaselineCheckpoint(tmp_path, "math_noise", 0, "default", models)
    assert resumed.done == {"act": {"selected": {"tag": 1}}, "ig": {"selected": {"tag": 2}}}
    retrained = {**models, "memorized": {"cache": "/c/other"}}
    assert BaselineCheckpoint(tmp_path, "math_noise", 0, "default", retrained).done == {}
    assert BaselineCheckpoint(tmp_path, "math_noise", 1, "default", models).done == {}
    BaselineCheckpoint.clear(tmp_path, {"setting": "math_noise", "seed": 0, "preset": "default"})
    assert not (tmp_path / "partial").exists()


def test_results_of_other_settings_are_kept_and_reruns_replace_them():
    from gss_bench.tinymem.run import merge_runs

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


def test_a_rerun_on_the_same_models_keeps_the_methods_it_did_not_run():
    """`make bench` (no baselines) after `--baselines all`: the baselines of that seed stay,
    named in methods_kept; not when the models differ."""
    from gss_bench.tinymem.run import _time_line, merge_runs

    models = {"memorizing": {"cache": "/c/m", "loaded": False}, "reference": {"cache": "/c/r"}}

    def run(methods, command, models=models):
        return {
            "setting": "math_noise",
            "seed": 0,
            "preset": "default",
            "models": models,
            "data": {"rows": 3},
            "methods": {name: {"selected": command} for name in methods},
            "command": command,
        }

    full = run(["GSS", "act", "ig"], "with baselines")
    loaded = {**models, "memorizing": {"cache": "/c/m", "loaded": True}}
    (merged,) = merge_runs([full], [run(["GSS"], "make bench", loaded)])
    assert merged["methods"] == {
        "GSS": {"selected": "make bench"},
        "act": {"selected": "with baselines"},
        "ig": {"selected": "with baselines"},
    }
    assert merged["methods_kept"] == {"act": "with baselines", "ig": "with baselines"}
    merged["seconds"] = {"total": 1.0}
    assert "math_noise seed 0: act, ig from `with baselines`" in _time_line([merged], 1.0)
    # a third run keeps naming the run that measured them
    (again,) = merge_runs([merged], [run(["GSS"], "make bench again", loaded)])
    assert again["methods_kept"] == {"act": "with baselines", "ig": "with baselines"}
    retrained = {**models, "memorizing": {"cache": "/c/m", "tokens_per_second": 2.0}}
    (other,) = merge_runs([full], [run(["GSS"], "retrained", retrained)])
    assert list(other["methods"]) == ["GSS"] and "methods_kept" not in other


def test_summary_compares_methods_on_the_rows_protect_held_out():
    """The summary's fair comparison for protect: the noised rows its search never saw, by
    method and seed mean; nothing for runs without them (backdoors, protect not run)."""
    from gss_bench.tinymem.run import heldout_table

    def run(setting, seed, by_method, rows):
        held = {"rows": rows, "memorized": by_method["GSS protect"], "by_method": by_method}
        return {
            "setting": setting,
            "seed": seed,
            "methods": {"GSS protect": {"heldout_rows": held}},
        }

    records = [
        run("math_noise", 0, {"Unmitigated": 60.0, "GSS-TR": 20.0, "GSS protect": 10.0}, 90),
        run("math_noise", 1, {"Unmitigated": 50.0, "GSS-TR": 10.0, "GSS protect": 20.0}, 110),
        {"setting": "math_backdoor", "seed": 0, "methods": {"GSS protect": {}}},
    ]
    table = heldout_table(records)
    assert "| Method | math noise: % Mem on 90 / 110 held-out rows |" in table
    assert "| Unmitigated | 55.0 ± 7.1 |" in table and "| GSS protect | 15.0 ± 7.1 |" in table
    assert "| GSS-TR | 15.0 ± 7.1 |" in table and "backdoor" not in table
    assert heldout_table(records[2:]) == ""
