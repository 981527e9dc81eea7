"""The lm-eval bridge (`gss.evaluate.lm_eval_bridge`, `gss evaluate --lm-eval`): lm-eval tasks
run on a model unsteered and steered in one call, offline, on a tiny Llama with local tasks.

The tasks are YAML files written here whose documents are a local JSON-lines file, so nothing
is downloaded; lm-eval's ~15,000 built-in tasks are indexed once (seconds), where a name not
among the local tasks must be looked for among them.
Skipped where lm-eval is not installed (it is an optional dependency: the ``lm-eval`` extra).
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import pytest
import torch

import gss
from gss.cli import main
from gss.errors import GSSError
from gss.evaluate.lm_eval_bridge import (
    LMEvalComparison,
    lm_eval_steering,
    lm_eval_tasks,
    run_lm_eval,
)

from ..helpers import calibrated_llama, word_tokenizer

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (the lm-eval extra)")
try:  # lm-eval without its [hf] extra (accelerate) has no HFLM: skipped, saying why
    from lm_eval.models.huggingface import HFLM
except ImportError as e:
    pytest.skip(f"lm-eval's HFLM does not import here ({e})", allow_module_level=True)
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS = "gss_tiny_ll,gss_tiny_mc"
RUNS = ("unsteered", "steered")
# bootstrap_iters=0: no resampled stderr (the perplexity's), which only costs time here
FAST = {"bootstrap_iters": 0, "limit": 6, "batch_size": 4}


def _task(name: str, docs, cache, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\n"
        f"  cache_dir: {cache}\ntest_split: test\n{body}"
    )


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """Two tasks on the same 8 documents: the loglikelihood of a 2-word continuation
    (perplexity: any change of the logits moves it) and a 2-way multiple choice."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    docs = [
        {
            "context": " ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(6)),
            "target": f"w{(i * 5) % 44} w{(i * 3) % 44}",
            "choices": [f"w{i % 44}", f"w{(i + 9) % 44}"],
            "label": i % 2,
        }
        for i in range(8)
    ]
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cache = root / "hf-cache"
    loglikelihood = (
        'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    choice = (
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{label}}"\n'
        'doc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
    )
    (root / "ll.yaml").write_text(_task("gss_tiny_ll", path, cache, loglikelihood))
    (root / "mc.yaml").write_text(_task("gss_tiny_mc", path, cache, choice))
    return root


@pytest.fixture(scope="module")
def steered():
    """A tiny Llama, a steer strong enough to change its logits, and a tokenizer for it."""
    model, artifact = calibrated_llama()
    return model, artifact, word_tokenizer()


def _direct(model, tokenizer, tasks_dir) -> dict:
    """lm-eval as a user would call it by hand: HFLM around the model, simple_evaluate."""
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=TASKS.split(","),
        task_manager=manager,
        limit=FAST["limit"],
        bootstrap_iters=0,
        log_samples=False,
    )
    return out["results"]


@pytest.fixture(scope="module")
def comparison(steered, tasks_dir) -> LMEvalComparison:
    model, artifact, tokenizer = steered
    start = time.perf_counter()
    result = lm_eval_steering(
        model, artifact, TASKS, tokenizer=tokenizer, include_path=tasks_dir, **FAST
    )
    print(f"lm_eval_steering: {time.perf_counter() - start:.2f} s")
    return result


def _logits(model):
    ids = torch.tensor([[5, 9, 14, 20, 7, 33]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_unsteered_run_is_lm_eval_on_the_bare_model(steered, tasks_dir, comparison):
    model, _, tokenizer = steered
    assert comparison.unsteered["results"] == _direct(model, tokenizer, tasks_dir)


def test_the_steered_run_is_lm_eval_with_the_steer_attached_by_hand(steered, tasks_dir, comparison):
    model, artifact, tokenizer = steered
    with gss.steer(model, artifact):
        by_hand = _direct(model, tokenizer, tasks_dir)
    assert comparison.steered is not None
    assert comparison.steered["results"] == by_hand
    # the steer fired: it moves the loglikelihoods, hence the perplexity of the continuations
    ppl = {r.metric: r for r in comparison.rows() if r.task == "gss_tiny_ll"}["perplexity"]
    assert ppl.unsteered is not None and ppl.steered is not None
    assert ppl.steered != pytest.approx(ppl.unsteered, rel=1e-6)
    assert comparison.gate_open_share is not None and comparison.gate_open_share > 0


def test_the_model_is_left_unsteered_and_in_its_mode(steered, tasks_dir):
    model, artifact, tokenizer = steered
    before = _logits(model)
    model.train()
    try:
        lm_eval_steering(
            model, artifact, "gss_tiny_ll", tokenizer=tokenizer, include_path=tasks_dir, **FAST
        )
        assert model.training  # HFLM put it in eval mode for the runs, and no longer
    finally:
        model.eval()
    assert torch.equal(_logits(model), before)


def test_the_table_and_record(comparison):
    rows = comparison.rows()
    assert {(r.task, r.metric) for r in rows} == {
        ("gss_tiny_ll", "perplexity"),
        ("gss_tiny_ll", "acc"),
        ("gss_tiny_mc", "acc"),
        ("gss_tiny_mc", "acc_norm"),
    }
    for r in rows:
        assert r.difference == pytest.approx(r.steered - r.unsteered)
    assert {r.metric: r.higher_is_better for r in rows if r.task == "gss_tiny_ll"} == {
        "perplexity": False,
        "acc": True,
    }
    table = comparison.table()
    assert table.splitlines()[0] == (
        "| task | metric | unsteered | steered | difference | better |"
    )
    assert len(table.strip().splitlines()) == 2 + len(rows)
    record = json.loads(json.dumps(comparison.record("m", "s"), allow_nan=False))
    assert record["tasks"] == ["gss_tiny_ll", "gss_tiny_mc"] and record["limit"] == 6
    assert record["rows"][0]["difference"] is not None
    assert set(record["lm_eval"]) == {"unsteered", "steered"}
    assert record["lm_eval"]["steered"]["n-samples"]["gss_tiny_ll"]["effective"] == 6


def test_without_a_steer_only_the_unsteered_run(steered, tasks_dir, comparison):
    model, _, tokenizer = steered
    alone = lm_eval_steering(
        model, None, "gss_tiny_mc", tokenizer=tokenizer, include_path=tasks_dir, **FAST
    )
    assert alone.steered is None and alone.gate_open_share is None
    assert (
        alone.unsteered["results"]["gss_tiny_mc"] == comparison.unsteered["results"]["gss_tiny_mc"]
    )
    assert alone.table().splitlines()[0] == "| task | metric | unsteered | better |"


def test_only_the_include_path_is_indexed_and_globs_expand(tasks_dir):
    selected = lm_eval_tasks("gss_tiny_*", tasks_dir)
    assert selected.names == ("gss_tiny_ll", "gss_tiny_mc")
    assert sorted(selected.manager.all_tasks) == ["gss_tiny_ll", "gss_tiny_mc"]


def test_an_unknown_task_is_one_error_saying_how_to_find_tasks(tasks_dir, monkeypatch):
    # lm-eval's own tasks left out: indexing them takes seconds (the command's test does it)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", partial(TaskManager, include_defaults=False))
    with pytest.raises(GSSError, match="lm-eval ls tasks") as err:
        lm_eval_tasks("gss_tiny_lx", tasks_dir)
    assert "gss_tiny_lx" in str(err.value) and "did you mean gss_tiny_ll" in str(err.value)
    with pytest.raises(GSSError, match="not a directory"):
        lm_eval_tasks("gss_tiny_ll", tasks_dir / "nope")
    with pytest.raises(GSSError, match="no lm-eval task named"):
        lm_eval_tasks(" , ", tasks_dir)


def test_arguments_that_would_break_the_comparison_are_refused(steered, tasks_dir):
    model, _, tokenizer = steered
    selected = lm_eval_tasks("gss_tiny_ll", tasks_dir)
    for bad in ({"use_cache": "cache"}, {"limit": 3}):
        with pytest.raises(GSSError, match="evaluate_args may not set"):
            run_lm_eval(model, selected, tokenizer=tokenizer, evaluate_args=bad)
    for limit in (0, float("inf"), float("nan")):
        with pytest.raises(GSSError, match="lm-eval limit must be a number > 0"):
            run_lm_eval(model, selected, tokenizer=tokenizer, limit=limit)
    with pytest.raises(GSSError, match="few-shot count must be an integer >= 0"):
        run_lm_eval(model, selected, tokenizer=tokenizer, num_fewshot=-1)
    # refused before any run, not by lm-eval from deep inside (or taken silently)
    for kwargs, message in (
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"bootstrap_iters": -1}, "bootstrap_iters must be an integer >= 0"),
        ({"evaluate_args": {"nope": 1}}, r"evaluate_args \['nope'\] are not arguments"),
        ({"model_args": {"pretrained": "gpt2"}}, "model_args may not set pretrained"),
    ):
        with pytest.raises(GSSError, match=message):
            run_lm_eval(model, selected, tokenizer=tokenizer, **kwargs)
    with pytest.raises(GSSError, match="lm-eval tasks are names"):
        lm_eval_tasks(None, tasks_dir)  # type: ignore[arg-type]


def test_without_lm_eval_one_error_says_how_to_install_it(monkeypatch, steered, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    model, artifact, tokenizer = steered
    with pytest.raises(GSSError, match=r"pip install 'gated-subspace-steering\[lm-eval\]'"):
        lm_eval_steering(model, artifact, "gss_tiny_ll", tokenizer=tokenizer)
    # the command says so before it loads anything (the model here does not exist)
    args = ["evaluate", "--model", str(tmp_path / "no-model"), "--lm-eval", "gss_tiny_ll"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "needs lm-eval" in err and "gated-subspace-steering[lm-eval]" in err


@pytest.fixture(scope="module")
def saved(steered, tmp_path_factory):
    """The model, its tokenizer and its steer saved, as the command line reads them."""
    model, artifact, tokenizer = steered
    root = tmp_path_factory.mktemp("lm_eval_cli")
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    artifact.save_pretrained(root / "steer")
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(6)]
    (root / "data.txt").write_text("\n".join(lines) + "\n")
    return root


def test_gss_evaluate_lm_eval_alone_writes_its_files(saved, tasks_dir, comparison, capsys):
    out = saved / "out"
    args = ["evaluate", "--model", str(saved / "model"), "--steer", str(saved / "steer")]
    args += ["--lm-eval", TASKS, "--lm-eval-include", str(tasks_dir), "--lm-eval-limit", "6"]
    args += ["--batch-size", "4", "--no-progress", "--out", str(out)]
    capsys.readouterr()  # what the fixtures printed
    start = time.perf_counter()
    assert main(args) == 0, capsys.readouterr().err
    took = time.perf_counter() - start
    printed, err = capsys.readouterr()
    print(f"gss evaluate --lm-eval: {took:.2f} s")
    assert "%|" not in err and "it/s]" not in err  # --no-progress: lm-eval's bars too
    assert "| task | metric | unsteered | steered | difference | better |" in printed
    written = sorted(p.name for p in out.iterdir())
    assert written == [".gss-written.json", "lm_eval.json", "lm_eval.md"]  # + what gss wrote
    record = json.loads((out / "lm_eval.json").read_text())
    assert record["model"] == str(saved / "model") and record["steer"] == str(saved / "steer")
    # the saved model, loaded back, gives what the one in memory gave (the stderr aside: the
    # command keeps lm-eval's bootstrap, the fixture skipped it)
    by_cli = {(r["task"], r["metric"], run): r[run] for r in record["rows"] for run in RUNS}
    in_memory = {
        (r.task, r.metric, run): getattr(r, run) for r in comparison.rows() for run in RUNS
    }
    assert by_cli == pytest.approx(in_memory, rel=1e-6)
    assert (out / "lm_eval.md").read_text() in printed
    # never over earlier results
    assert main(args) == 2
    assert "already holds lm_eval.json, lm_eval.md" in capsys.readouterr().err


def test_gss_evaluate_runs_both_with_memorized_and_lm_eval(saved, tasks_dir, capsys):
    out = saved / "both"
    data = str(saved / "data.txt")
    args = ["evaluate", "--model", str(saved / "model"), "--memorized", data, "--heldout", data]
    args += ["--k", "4", "--n", "8", "--lm-eval", "gss_tiny_mc", "--lm-eval-fewshot", "1"]
    args += ["--lm-eval-include", str(tasks_dir), "--lm-eval-limit", "4", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0, capsys.readouterr().err
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        ".gss-written.json",  # what gss wrote there, for --overwrite
        "evaluation.json",
        "evaluation.md",
        "lm_eval.json",
        "lm_eval.md",
    ]
    record = json.loads((out / "lm_eval.json").read_text())
    assert record["num_fewshot"] == 1 and record["steer"] is None
    assert record["lm_eval"]["unsteered"]["n-shot"] == {"gss_tiny_mc": 1}


@pytest.mark.heavy  # lm-eval indexes its ~15,000 own tasks: seconds
def test_a_name_not_among_the_local_tasks_is_looked_for_among_lm_evals_own(tasks_dir):
    selected = lm_eval_tasks("gss_tiny_ll,hellaswag", tasks_dir)  # hellaswag is lm-eval's
    assert selected.names == ("gss_tiny_ll", "hellaswag")
    assert len(selected.manager.all_tasks) > 1000


def test_gss_evaluate_checks_its_inputs_before_loading_the_model(
    saved, tasks_dir, monkeypatch, capsys
):
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", partial(TaskManager, include_defaults=False))
    missing = str(saved / "no-model")  # never loaded: each error comes first
    data = str(saved / "data.txt")
    cases = [
        ([], "give --memorized and --heldout"),
        (["--memorized", data], "give --heldout"),
        (["--lm-eval", "nope_task", "--lm-eval-include", str(tasks_dir)], "lm-eval ls tasks"),
        (["--memorized", data, "--heldout", data, "--lm-eval-limit", "3"], "is for --lm-eval"),
        (["--lm-eval", "gss_tiny_ll", "--lm-eval-limit", "-1"], "limit must be a number > 0"),
        (["--lm-eval", "gss_tiny_ll", "--lm-eval-fewshot", "-1"], "count must be an integer"),
        (["--lm-eval", "gss_tiny_ll", "--lm-eval-limit", "1.5"], "Give 1, or a share"),
        (["--memorized", data, "--heldout", data, "--lm-eval-limit", "0"], "is for --lm-eval"),
        (["--memorized", data, "--heldout", data, "--lm-eval-fewshot", "0"], "is for --lm-eval"),
    ]
    for extra, message in cases:
        assert main(["evaluate", "--model", missing, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_the_delta_of_the_steered_run_is_recorded(steered, tasks_dir, comparison):
    model, artifact, tokenizer = steered
    result = lm_eval_steering(
        model,
        artifact,
        "gss_tiny_ll",
        tokenizer=tokenizer,
        include_path=tasks_dir,
        delta=0.5,
        **FAST,
    )
    assert result.record()["options"] == {"delta": 0.5}
    assert "options" not in comparison.record()  # the artifact's own delta: nothing overridden


def test_a_steering_stack_is_attached_whole(steered, tasks_dir, comparison):
    model, artifact, tokenizer = steered
    stack = gss.SteeringStack((artifact,))
    with pytest.raises(GSSError, match="a steering stack takes no options"):
        lm_eval_steering(model, stack, TASKS, tokenizer=tokenizer, delta=2.0)  # before any run
    result = lm_eval_steering(
        model, stack, TASKS, tokenizer=tokenizer, include_path=tasks_dir, **FAST
    )
    assert result.steered is not None and comparison.steered is not None
    assert result.steered["results"] == comparison.steered["results"]
    assert result.gate_open_share == pytest.approx(comparison.gate_open_share)


def test_the_docs_lm_eval_example_runs(steered, tmp_path, monkeypatch, capsys):
    """docs/api.md's task YAML and Python example, as written, on the tiny Llama and its steer
    standing in for the user's fine-tune and artifact."""
    import re

    import datasets

    from ..test_docs import DOCS, section

    text = section(DOCS / "api.md", "## Utility beyond perplexity: lm-eval")
    yaml = re.search(r"```yaml\n(.*?)```", text, re.S)
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert yaml is not None and code is not None
    model, artifact, tokenizer = steered
    model.save_pretrained(tmp_path / "ft")
    tokenizer.save_pretrained(tmp_path / "ft")
    artifact.save_pretrained(tmp_path / "gss-artifact")
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "my_task.yaml").write_text(yaml.group(1))
    rows = [
        {"question": f"w{i} w{i + 1} w{i + 2}", "choices": [f"w{i + 3}", f"w{i + 9}"], "answer": 0}
        for i in range(5)
    ]
    (tmp_path / "my_tasks" / "my_task.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), "api.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "| task | metric | unsteered | steered | difference | better |" in printed
    assert "| my_task | acc |" in printed


def test_a_task_whose_data_cannot_load_is_one_message(saved, tasks_dir, tmp_path, capsys):
    """A local task whose data file is gone (or, offline, a task whose data is not cached):
    one line naming the task's data and what to do, not a traceback from datasets."""
    missing = tmp_path / "tasks"
    missing.mkdir()
    body = 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
    (missing / "gone.yaml").write_text(
        _task("gss_tiny_gone", tmp_path / "nowhere.jsonl", tmp_path / "cache", body)
    )
    args = ["evaluate", "--model", str(saved / "model"), "--lm-eval", "gss_tiny_gone"]
    args += ["--lm-eval-include", str(missing), "--no-progress", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "lm-eval could not load the data of gss_tiny_gone" in err, err


@pytest.mark.heavy  # lm-eval indexes its ~15,000 own tasks: seconds
def test_one_of_lm_evals_own_tasks_offline_and_not_cached_is_one_message(saved, tmp_path, capsys):
    """hellaswag's data is not in a fresh machine's datasets cache (CI's): offline, one line."""
    args = ["evaluate", "--model", str(saved / "model"), "--lm-eval", "hellaswag"]
    args += ["--lm-eval-limit", "2", "--no-progress", "--out", str(tmp_path / "out")]
    assert main(args) == 2  # HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (autouse fixture)
    err = capsys.readouterr().err
    assert "lm-eval could not load the data of hellaswag" in err, err
