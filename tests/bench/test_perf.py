"""`gss bench perf --quick` end to end: every part runs and writes its files and ratios.

No timing thresholds: this only checks that the benchmark measures something sensible (every
ratio a positive finite number), not how fast this machine is.
"""

import json
import math

import pytest
import torch

from gss.hf.blocks import resolve_layer
from gss_bench.perf.common import QUICK, interleaved, random_ids, tiny_model
from gss_bench.perf.overhead import (
    AlternatingSteps,
    _generate,
    as_forward_hook,
    load_local_model,
    model_name,
)
from gss_bench.perf.run import main


def _ratios(node, path=""):
    """Every summary stored under a key naming a ratio, anywhere in the results."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            if (key == "ratio" or "_over_" in key) and isinstance(value, dict):
                yield here, value
            else:
                yield from _ratios(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _ratios(value, f"{path}[{i}]")


def test_quick_perf_writes_results_table_and_figures(tmp_path, capsys):
    out = tmp_path / "perf"
    assert main(["--quick", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["parts"]) == {
        "overhead",
        "calibration",
        "solve",
        "memory",
        "adapters",
        "audit",
    }
    (timed,) = results["parts"]["audit"]["models"]
    assert timed["rows_per_second"] > 0 and timed["vs_two_forwards"]["median"] > 0
    assert (out / "audit.png").stat().st_size > 1000
    assert "## Audit speed" in (out / "table.md").read_text()
    for key in ("cpu_count", "threads", "torch", "platform", "cpu", "cpu_capability"):
        assert results["machine"][key]

    ratios = list(_ratios(results))
    assert len(ratios) >= 6 + 1 + 6  # overhead rows, calibration, solve rows
    for where, summary in ratios:
        for stat in ("median", "q1", "q3"):
            value = summary[stat]
            assert math.isfinite(value) and value > 0, f"{where}.{stat} = {value}"

    overhead = results["parts"]["overhead"]
    rows = overhead["models"][0]["rows"]
    assert {(r["batch"], r["rank"]) for r in rows} == {
        (1, 1),
        (1, 4),
        (1, 16),
        (4, 1),
        (4, 4),
        (4, 16),
    }
    for r in rows:
        assert r["tokens_per_s_steered"]["median"] > 0
        assert 0.0 <= r["gate_open_share"] <= 1.0
        # every timed decode step was recorded (4 new tokens: 3 steps after the prompt pass)
        assert r["decode_step_seconds"]["steered"]["n"] == 2 * 3
        assert math.isfinite(r["step_ratio"]) and r["step_ratio"] > 0
        assert r["hook_seconds_per_call"] > 0 and 0 < r["hook_share_of_step"] < 1
        assert r["hook_seconds_in_generate"] > 0
        assert math.isfinite(r["aa_ratio"]["median"]) and r["aa_ratio"]["median"] > 0
        # 2 timed rounds (after 1 warm-up call), each one call with its steps alternating
        alternating = r["alternating_step_ratio"]
        assert alternating["n"] == 2 and math.isfinite(alternating["median"])
        assert alternating["median"] > 0
        assert r["alternating_noop_ratio"]["n"] == 2
        # the same steer as a forward hook, beside the wrapped forward, at the peer's rank
        as_hook = r.get("alternating_step_ratio_forward_hook")
        assert (as_hook is not None) == (r["rank"] == QUICK.peer_rank)
        assert as_hook is None or as_hook["n"] == 2
        assert not any("kernel" in key for key in r)  # one steer: no compiled arm
    assert overhead["peer"] in ("available", "not installed")

    calib = results["parts"]["calibration"]
    assert {"signal", "statistics", "solve", "thresholds"} <= set(calib["phases"])
    profile = (out / "profile.txt").read_text()
    assert "calibrate" in profile and "cumulative" in profile

    solve = results["parts"]["solve"]["rows"]
    assert {r["d"] for r in solve} == {64, 128}
    assert all("median" in r["full"] and r["singular_value_rel_error"] < 1e-3 for r in solve)
    assert all(r["steer_min_cos"] > 0.999 and r["probe_min_cos"] > 0.999 for r in solve)
    assert all(r["converged"] for r in solve)

    memory = results["parts"]["memory"]["rows"]
    assert [r["texts"] for r in memory] == [8, 32]
    assert all(r["peak_rss_mb"] > 0 for r in memory)
    streaming = results["parts"]["memory"]["streaming_rows"]
    assert [r["texts"] for r in streaming] == [8, 32]

    lora = results["parts"]["adapters"]  # peft is a dev dependency
    assert [r["reference"] for r in lora["rows"]] == ["loaded", "adapters-off"]
    assert lora["same_artifact"] and all(r["peak_rss_mb"] > 0 for r in lora["rows"])
    assert (out / "adapters.png").is_file() and "adapters_off lowers the peak" in (
        out / "table.md"
    ).read_text()
    assert "keep_general=0" in (out / "table.md").read_text()

    for name in ("overhead", "calibration", "solve", "memory"):
        assert (out / f"{name}.png").stat().st_size > 1000
    table = (out / "table.md").read_text()
    assert "## Inference overhead" in table and "## Solve scaling" in table
    assert "wrote" in capsys.readouterr().out


def test_full_svd_is_skipped_above_max_full_d(tmp_path):
    out = tmp_path / "solve"
    args = ["--quick", "--only", "solve", "--max-full-d", "64", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    rows = json.loads((out / "results.json").read_text())["parts"]["solve"]["rows"]
    big = [r for r in rows if r["d"] == 128]
    assert big and all("skipped" in r["full"] for r in big)
    assert all(r["truncated"]["median"] > 0 for r in big)
    assert "skipped" in (out / "table.md").read_text()


def test_interleaved_runs_every_arm_each_round_in_a_varying_reproducible_order():
    def rounds():
        calls: list[str] = []
        arms = {name: (lambda name=name: calls.append(name) or 1.0) for name in "abcd"}
        times = interleaved(arms, repeats=6, warmup=1, desc="", progress=False)
        assert all(len(t) == 6 for t in times.values())
        return [calls[i : i + 4] for i in range(4, len(calls), 4)]  # after the warm-up round

    orders = rounds()
    assert len(orders) == 6 and all(sorted(o) == list("abcd") for o in orders)
    assert len({tuple(o) for o in orders}) > 2  # neither fixed nor merely reversed
    assert rounds() == orders  # seeded: the same orders on every run


def test_quick_perf_in_bfloat16_records_its_dtype_and_skips_memory(tmp_path):
    out = tmp_path / "bf16"
    parts = "overhead,calibration,solve,memory"
    args = ["--quick", "--only", parts, "--dtype", "bfloat16", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["dtype"] == results["machine"]["dtype"] == "bfloat16"
    assert results["device"] == results["machine"]["device"] == "cpu"
    overhead = results["parts"]["overhead"]
    assert overhead["dtype"] == "bfloat16"
    keys = ["ratio", "aa_ratio", "noop_over_unsteered", "gss_over_noop", "alternating_step_ratio"]
    for row in overhead["models"][0]["rows"]:
        for key in keys:
            value = row[key]["median"]
            assert math.isfinite(value) and value > 0, f"{key} = {value}"
    assert results["parts"]["calibration"]["dtype"] == "bfloat16"
    assert math.isfinite(results["parts"]["calibration"]["ratio"]["median"])
    # host RSS of float32 CPU calibration says nothing about bfloat16: skipped, and said so
    assert "skipped" in results["parts"]["memory"]
    table = (out / "table.md").read_text()
    assert "device cpu, bfloat16" in table and "Skipped:" in table
    assert not (out / "memory.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_device_cuda_without_cuda_exits_with_a_clear_message(tmp_path):
    out = tmp_path / "cuda"
    with pytest.raises(SystemExit) as info:
        main(["--quick", "--device", "cuda", "--out", str(out), "--no-progress"])
    message = str(info.value)
    assert message.startswith("gss bench perf:") and "torch.cuda.is_available() is False" in message
    assert not out.exists()  # refused before anything ran or was written


def test_alternating_steps_steer_every_other_decode_step_and_flip_with_the_parity():
    model = tiny_model(QUICK)
    _, block = resolve_layer(model, 1)
    ids = random_ids(1, 5, QUICK.vocab, seed=0)
    seen: list[int] = []  # the sequence length each call of the hook saw

    def counting(module, args, output):
        seen.append(output.shape[1] if isinstance(output, torch.Tensor) else output[0].shape[1])

    def call() -> float:
        _generate(model, ids, 6)  # a prompt pass, then decode steps 1..5
        return 0.0

    alternating = AlternatingSteps(model, block)
    ratio = alternating.run(counting, call, parity=0)
    assert math.isfinite(ratio) and ratio > 0
    assert seen == [1, 1, 1]  # steps 1, 3, 5; never the prompt pass
    assert [len(alternating.steps[False]), len(alternating.steps[True])] == [2, 3]
    seen.clear()
    alternating.run(counting, call, parity=1)
    assert seen == [1, 1] and len(alternating.steps[True]) == 2  # steps 2, 4
    assert "forward" not in vars(block)  # nothing left on the block between calls
    seen.clear()
    alternating.run(counting, call, parity=0, install=as_forward_hook)
    assert seen == [1, 1, 1] and not block._forward_hooks  # on and off as a forward hook
    seen.clear()
    _generate(model, ids, 3)  # outside run: dormant
    assert seen == [] and len(alternating.steps[True]) == 3  # the last run's, untouched
    alternating.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_model_directory_with_only_a_config_gives_its_shape_with_random_weights(tmp_path):
    tiny_model(QUICK).config.save_pretrained(tmp_path / "shape")  # config.json, no weights
    model, _ = load_local_model(str(tmp_path / "shape"), dtype=torch.bfloat16)
    config = tiny_model(QUICK).config
    assert model.config.hidden_size == config.hidden_size
    assert model.config.num_hidden_layers == config.num_hidden_layers
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    again, _ = load_local_model(str(tmp_path / "shape"), dtype=torch.bfloat16)
    pairs = zip(model.parameters(), again.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)  # seeded: the same shape, the same weights
    assert model_name(str(tmp_path / "shape")) == "shape (random weights)"


def test_kept_parts_say_which_machine_measured_them(tmp_path):
    """``--only`` keeps the other parts of an earlier results.json; the table names the machine
    each kept part came from, which older files recorded once, for their last command only."""
    out = tmp_path / "kept"
    out.mkdir()
    old_machine = {"cpu_count": 2, "threads": 2, "torch": "x", "platform": "Old-Linux"}
    skipped = {"skipped": "not run here"}
    old = {
        "command": "gss bench perf --only memory",
        "device": "cpu",
        "dtype": "float32",
        "machine": old_machine,
        "parts": {"memory": skipped, "adapters": skipped},
        "part_commands": {"memory": "gss bench perf --only memory", "adapters": "older"},
    }
    (out / "results.json").write_text(json.dumps(old))
    args = ["--quick", "--only", "solve", "--max-full-d", "64", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    machines = results["part_machines"]
    assert machines["solve"] == results["machine"] and machines["memory"] == old_machine
    assert "adapters" not in machines  # measured by a run whose machine nobody recorded
    table = (out / "table.md").read_text()
    assert "memory (`gss bench perf --only memory`; on Old-Linux)" in table
    assert "adapters (`older`; machine not recorded)" in table


def test_protect_part_times_both_searches_and_says_where_the_time_goes(
    tmp_path, tinymem_cache, monkeypatch
):
    """`--only protect` (opt-in): issue 72's search beside the search before it, on the quick
    TinyMem models, each arm's time split by protect itself; kept parts stay."""
    monkeypatch.setenv("GSS_CACHE_DIR", str(tinymem_cache))
    out = tmp_path / "perf"
    assert main(["--quick", "--only", "protect", "--out", str(out), "--no-progress"]) == 0
    part = json.loads((out / "results.json").read_text())["parts"]["protect"]
    assert set(part["arms"]) == {"issue 72", "before issue 72"}
    assert part["ratio"]["n"] == 1 and part["ratio"]["median"] > 0
    for record in part["arms"].values():
        steps = record["seconds"]
        assert steps["search"] > 0 and steps["total"] >= steps["search"]
        assert "block stage" in record["search_seconds"]["stages"]
        assert "calibration" in record["search_seconds"]["work"]
    work = {name: r["search_seconds"]["work"] for name, r in part["arms"].items()}
    # the arm before issue 72 holds no point to the data's rows or the reference's replies
    assert "reference continuations" in work["issue 72"]
    assert "reference continuations" not in work["before issue 72"]
    assert "replies check" not in work["before issue 72"]
    table = (out / "table.md").read_text()
    assert "## gss protect: issue 72's search beside the search before it" in table
    assert (out / "protect.png").stat().st_size > 1000


def test_protect_is_asked_for_by_name_only(tmp_path):
    from gss_bench.perf.run import OPT_IN, PARTS, build_parser

    assert "protect" in OPT_IN and "protect" not in PARTS
    assert "protect" not in build_parser().parse_args([]).only.split(",")
