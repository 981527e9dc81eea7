"""``gss bench canaries``: secret sharer on a real pretrained model, mitigated by GSS.

1. Load the base model (default: SmolLM2-135M-Instruct from `gss models get`, fetched once;
   ``--model gemma3-270m``: Gemma 3 270M base, its rows starting with ``<bos>``, no ``--chat``);
   plant canaries in Shakespeare passages (``--chat``: in conversations rendered by the chat
   template, each secret the assistant's reply to a question); fine-tune the top blocks (or,
   with ``--lora R``, a LoRA on them; with ``--chat --replies-only``, on the assistant's
   messages alone) until they are memorized (cached by config hash, so a rerun skips it).
   With a LoRA, every reference pass below uses ``gss.adapters_off(model)``.
2. Measure the fine-tuned model: (n, k)-memorization of the canaries (greedy), per-token match,
   held-out perplexity; the pilot statistics of omega with the base model as reference.
3. Scan every block's signal strength in one pass (plot), calibrate GSS (and the GSS-TR variant;
   with ``--chat``, GSS with only the replies memorizable too) at the strongest block the
   fine-tune changed, sweep delta, then the gate's threshold percentile at the chosen delta;
   sweep mean-difference steering's strength.
4. At every grid point, also decode greedily from every canary's prompt and count the secrets
   (account numbers, addresses) said verbatim, its own and the other canaries'. Per method,
   among the points whose perplexity stays within 5% of the unmitigated model's, select the
   lowest memorization, then the fewest secrets said, then the fewest canaries saying another's
   secret, then the lowest perplexity; re-measure it with greedy decoding, and report %
   memorized, the secrets said, perplexity, DS_lambda, mitigation time, every grid point, a
   Pareto figure, and what each model answers to one memorized canary's prompt.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gss import __version__
from gss.errors import GSSError
from gss.evaluate.leaks import EXTRA_TOKENS
from gss.hf.forward import model_device
from gss.hf.loading import load_causal_lm
from gss.protect import SearchSpace
from gss.report import machine_info, markdown_table, write_json
from gss_bench import baseline_names, transformers_bars_off
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.protect_report import check_report_dir

PPL_TOLERANCE = 0.05  # selected points keep perplexity within +5% of the unmitigated model
# Strengths of GSS (and GSS-TR). At block 22 both reach 0% memorized from 1.0, but the secrets
# said keep falling as delta grows (plain canaries), within the perplexity tolerance up to 8.0.
DELTAS = (0.03, 0.1, 0.25, 1.0, 4.0, 8.0, 16.0)
PERCENTILES = (90.0, 99.0)  # gate thresholds tried beside the default 95th, at the chosen delta
ALPHAS = (0.5, 1.0, 2.0)
LEAK_HEADER = ["% numbers out", "% addresses out", "% others' out", "% near-verbatim out"]
LEAK_HEADER += ["% replies' 4-grams repeated", "replies' base ppl"]
HEADER = ["method", "selected", "% memorized", "% tokens", *LEAK_HEADER, "perplexity"]
HEADER += ["DS 0.01", "DS 0.05", "DS 0.1", "mitigation s"]  # table.md's, then of every point:
GRID_HEADER = ["method", "point", "% memorized", *LEAK_HEADER, "perplexity", "selected"]
CALIBRATION_CLEAN_ROWS = 64  # clean fine-tuning rows beside the canaries in the calibration set
# `--ablation`: GSS as published with each change of the GSS-TR study (docs/gss-tr.md) alone, and
# all three; the toward-reference target alone is GSS-TR itself.
ABLATION: dict[str, dict[str, Any]] = {
    "GSS, omega > 1 nat": {"omega_threshold": 1.0},
    "GSS, per-position": {"gradient": "per-position"},
    "GSS, all three": {
        "omega_threshold": 1.0,
        "target": "toward-reference",
        "gradient": "per-position",
    },
}
QUICK = {"canaries": 8, "finetune_rows": 8, "heldout_rows": 8, "general_rows": 8}
QUICK.update(k=40, row_len=80)  # room for the lead-in with a byte-level tokenizer
# --chat: the prompt holds the chat template's turns and a question (about 55 tokens with
# SmolLM2's template), the reply about 40 tokens
CHAT = {"chat": True, "k": 96, "row_len": 144}
QUICK_CHAT = {**QUICK, "chat": True, "k": 200, "row_len": 320}  # byte tokens
DEFAULT_MODEL = "smollm2-135m"
# the share of the blocks fine-tuned by default: SmolLM2's top 8 of 30, so Gemma 3 270M's top 5
# of 18 (27.9M trained parameters against SmolLM2's 28.3M; block 17, the top one, one of Gemma's
# three global-attention blocks)
TRAIN_SHARE = 8 / 30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gss bench canaries", description=__doc__.split("\n")[0])
    _data_arguments(p.add_argument_group("the fine-tune and its data"))
    _method_arguments(p.add_argument_group("what is measured"))
    run = p.add_argument_group("the run")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default="cpu")
    run.add_argument("--threads", type=int, default=None)
    run.add_argument("--batch-size", type=int, default=16)
    run.add_argument("--cache-dir", help="fine-tuned weights (default ~/.cache/gss/canaries)")
    run.add_argument("--out", help="results folder (default results/canaries[-quick])")
    run.add_argument("--no-progress", action="store_true")
    return p


def _data_arguments(g: Any) -> None:
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="base model: a name of `gss models get` (smollm2-135m, gemma3-270m; fetched once) "
        f"or a model directory (default {DEFAULT_MODEL})",
    )
    g.add_argument("--quick", action="store_true", help="a small smoke version (tests)")
    g.add_argument("--canaries", type=int, default=None, help="number of canaries (default 32)")
    g.add_argument(
        "--chat",
        action="store_true",
        help="a chat fine-tune: every row a conversation rendered by the tokenizer's chat "
        "template, the secrets in the assistant's replies, prompted with the conversation up to "
        "the reply (k=96, n=144)",
    )
    g.add_argument(
        "--replies-only",
        action="store_true",
        help="with --chat: fine-tune on the assistant's messages alone (trl's "
        "assistant_only_loss) instead of every token",
    )
    g.add_argument(
        "--train-blocks",
        type=int,
        default=None,
        help="top blocks fine-tuned (default: 4/15 of them, rounded: SmolLM2's top 8 of 30, "
        "Gemma 3 270M's top 5 of 18)",
    )
    g.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="fine-tune a LoRA of this rank on the top blocks' projections instead of the "
        "blocks, and calibrate against gss.adapters_off(model) (needs peft)",
    )
    g.add_argument("--lr", type=float, default=FinetuneConfig.lr)
    g.add_argument("--max-epochs", type=int, default=FinetuneConfig.max_epochs)
    g.add_argument(
        "--clean-per-epoch",
        type=int,
        default=FinetuneConfig.clean_per_epoch,
        help="fresh clean rows trained on beside the canaries in each epoch",
    )


def _method_arguments(g: Any) -> None:
    g.add_argument("--rank", type=int, default=4)
    g.add_argument("--layer", type=int, help="steer this block instead of the scan's strongest")
    g.add_argument("--deltas", help=f"comma-separated GSS strengths (default {DELTAS})")
    g.add_argument(
        "--ablation",
        action="store_true",
        help="also calibrate GSS with each single change of the GSS-TR study (omega > 1 nat, "
        "per-position gradients) and with all three changes (slow: per-position gradients)",
    )
    g.add_argument(
        "--baselines",
        default="",
        help="also run these baselines over their default grids: comma-separated names "
        "(see `gss baselines`), families or 'all' (default none; the neuron and weight "
        "methods take hours on a 135M model)",
    )
    g.add_argument(
        "--protect",
        action="store_true",
        help="also run gss protect with its defaults (no hand-picked block or strength) and "
        "add its choice to the table, with its report in OUT/protect",
    )
    g.add_argument(
        "--protect-prefer",
        choices=["reference", "margin", "utility"],
        default=SearchSpace.prefer,
        help="with --protect: how points at the target are ranked (gss.SearchSpace.prefer)",
    )
    g.add_argument(
        "--protect-reply-check",
        type=int,
        default=SearchSpace.reply_check,
        help="with --protect: how many of the best points at the target have their replies "
        "checked for loops (gss.SearchSpace.reply_check; 0: off)",
    )


def _log(message: str) -> None:
    print(f"[canaries {time.strftime('%H:%M:%S')}] {message}", flush=True)


def default_cache() -> Path:
    env = os.environ.get("GSS_CACHE_DIR")
    return (Path(env).parent if env else Path.home() / ".cache" / "gss") / "canaries"


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _load(path: Path, device: str) -> tuple[Any, Any]:
    model: torch.nn.Module = load_causal_lm(path)
    return model.to(device).eval(), _tokenizer(path)


def model_path(model: str, progress: bool = True) -> Path:
    """`model`'s directory: a name of `gss models get` (fetched and converted the first time),
    else `model` itself, a path."""
    from gss_bench.models import KNOWN_MODELS, get_model

    if model in KNOWN_MODELS and not Path(model).is_dir():
        return get_model(model, progress=progress)
    return Path(model)


def check_chat(tokenizer: Any, base_path: Path) -> None:
    """`--chat` renders every row with the tokenizer's chat template: refused, before any
    work, for a model that has none (Gemma 3 270M is the base model)."""
    if not getattr(tokenizer, "chat_template", None):
        raise GSSError(
            f"--chat renders conversations with the tokenizer's chat template, and "
            f"{base_path.name}'s tokenizer has none (a base model, not an instruction-tuned "
            "one): run without --chat, or with a chat model (smollm2-135m)."
        )


def default_train_blocks(n_blocks: int) -> int:
    """The top blocks fine-tuned by default: `TRAIN_SHARE` of `n_blocks`, at least one."""
    return max(1, round(n_blocks * TRAIN_SHARE))


def canary_config(tokenizer: Any, seed: int = 0, **sizes: Any) -> Any:
    """The bench's `CanaryConfig` for `tokenizer`: plain rows start with its BOS token where its
    own encodings do (Gemma's), chat rows as its template starts them."""
    from gss_bench.canaries.data import CanaryConfig, adds_bos

    bos = not sizes.get("chat") and adds_bos(tokenizer)
    return CanaryConfig(seed=seed, bos=bos, **sizes)


def default_setup(
    chat: bool = False, model: str = DEFAULT_MODEL
) -> tuple[Path, Any, Any, Any, int]:
    """What the bench's default run starts from, for scripts that study its fine-tunes: the
    model's path (`model`: as `--model`, default SmolLM2-135M), the model and its tokenizer
    (CPU), the canary data of seed 0 at the bench's sizes (`chat`: `--chat`'s) and the pad id.
    Its fine-tune: ``FinetuneConfig(train_blocks=default_train_blocks(n))`` for n blocks."""
    from gss_bench.canaries.data import make_canary_data

    base_path = model_path(model)
    if chat:
        check_chat(_tokenizer(base_path), base_path)
    base, tokenizer = _load(base_path, "cpu")
    sizes: dict[str, Any] = dict(CHAT) if chat else {}
    data = make_canary_data(tokenizer, canary_config(tokenizer, seed=0, **sizes))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return base_path, base, tokenizer, data, pad


def _fingerprint(path: Path) -> dict[str, Any]:
    weights = sorted(path.glob("*.safetensors"))
    return {
        "config": (path / "config.json").read_text() if (path / "config.json").is_file() else "",
        "weights": [(w.name, w.stat().st_size) for w in weights],
    }


def finetuned(
    base: Any, base_path: Path, data: Any, cfg: Any, pad: int, cache: Path, tokenizer: Any
) -> tuple:
    from gss.signal.tokens import encode_trained
    from gss_bench.canaries.finetune import (
        cache_key,
        finetune,
        load_trained,
        save_trained,
        trainable_names,
    )
    from gss_bench.trained_on import key_suffix, trained_elsewhere

    device = model_device(base)
    key = cache_key(_fingerprint(base_path), data, cfg)
    folder = cache / f"{base_path.name}-{key}{key_suffix(device)}"
    loaded = load_trained(base, folder, cfg)
    if loaded is not None and not trained_elsewhere(loaded[1], device):
        _log(f"fine-tuned weights from {folder}")
        return loaded[0], {**loaded[1], "cache": str(folder), "loaded": True}
    what = f"a rank-{cfg.lora_rank} LoRA on the top" if cfg.lora_rank else "the top"
    _log(f"fine-tuning {what} {cfg.train_blocks} blocks on the canaries (cached in {folder})")
    masks = None
    if cfg.replies_only:  # the assistant's messages of each row, as calibration finds them
        chats, width = data.conversations, data.config.row_len
        masks = encode_trained(chats, tokenizer, width, replies_only=True)[1]
    model, info = finetune(base, data, cfg, pad, log=_log, loss_masks=masks)
    names = trainable_names(model, cfg.train_blocks, lora=bool(cfg.lora_rank))
    save_trained(model, names, info, folder)
    return model, {**info, "cache": str(folder), "loaded": False}


def _select(points: Sequence[Any], said: Sequence[dict[str, Any]], base_ppl: float) -> Any:
    """`gss.evaluate.select_point` over the points and their leak probes (`said`); if no point
    is within the perplexity tolerance, the mildest one."""
    from gss.evaluate.sweep import select_point

    own = [leaks["secrets_said"] for leaks in said]
    others = [leaks["others_leaked"] for leaks in said]
    i = select_point(
        points, base_ppl, tolerance=PPL_TOLERANCE, secrets_said=own, others_said=others
    )
    return points[0 if i is None else i]


def _leak_counts(said: dict[str, Any]) -> dict[str, float]:
    """A leak probe's percentages, without the example's reply."""
    return {key: value for key, value in said.items() if key != "reply"}


def _reply_cells(said: dict[str, Any]) -> list[str]:
    """A leak probe's table cells after the addresses: others' secrets said, then how the
    replies read."""
    keys = ("others_leaked", "secrets_near", "repetition", "reply_perplexity")
    return [f"{said.get(key, float('nan')):.1f}" for key in keys]


def _label(options: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in options.items() if value is not None)


def _quoted(text: str) -> str:
    """`text` on one line, fit for a Markdown code span."""
    return " ".join(text.replace("`", "'").split()) or "(nothing)"


@dataclass
class _Method:
    """A method's grid points, each point's mitigation seconds and leak probe (what the model
    says to the canaries' prompts), and how to apply one point: a context manager that yields
    the model to evaluate with that point in effect."""

    points: list[Any]
    seconds: list[float]
    said: list[dict[str, Any]]
    attach: Callable[[Any], AbstractContextManager[Any]]


def _index(points: Sequence[Any], point: Any) -> int:
    return next(i for i, p in enumerate(points) if p is point)


def _hooked(model: Any, handle: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`_Method.attach` for a steer: ``handle(point)`` attaches it to `model` (and detaches
    on exit)."""

    @contextmanager
    def attach(point: Any) -> Iterator[Any]:
        with handle(point):
            yield model

    return attach


def _baseline(
    name: str,
    model: Any,
    data: Any,
    measure: Callable[[Any], Any],
    probe: Callable[[Any], dict[str, Any]],
    base_ppl: float,
) -> _Method:
    """Every point of a baseline's default grid, measured with `measure` and `probe`.

    Only the edited copy the selection rule would pick so far is kept (a 135M model's grid
    then holds at most two copies in memory); a hook method is fitted again from its cache
    when its chosen point is re-measured.
    """
    from gss.evaluate.sweep import SweepPoint
    from gss_bench.baselines import get_method

    method = get_method(name)
    points: list[Any] = []
    seconds: list[float] = []
    said: list[dict[str, Any]] = []
    kept: dict[int, Any] = {}
    for params in method.grid:
        result = method.run(model, data, **params)
        try:
            report = measure(result.model)
            said.append(probe(result.model))
        finally:
            result.remove()
        points.append(SweepPoint(dict(params), report))
        seconds.append(result.total_seconds)
        if result.model is not model and _select(points, said, base_ppl) is points[-1]:
            kept = {len(points) - 1: result}
        del result
        _log(
            f"  {name} {params}: {report.memorized:.1f}% memorized, perplexity "
            f"{report.perplexity:.2f}, {said[-1]['secrets_said']:.1f}% of secrets said, "
            f"{seconds[-1]:.0f} s"
        )

    @contextmanager
    def attach(point: Any) -> Iterator[Any]:
        i = _index(points, point)
        result = kept.get(i) or method.run(model, data, **method.grid[i])
        try:
            yield result.model
        finally:
            result.remove()

    return _Method(points, seconds, said, attach)


def _leak_probe(
    tokenizer: Any, data: Any, report: Any, batch_size: int, judge: Any
) -> tuple[dict[str, Any], Callable[[Any], dict[str, Any]]]:
    """What a model says to every canary's prompt (`gss.evaluate.leaks`): ``probe(m)`` gives the
    % of canaries whose account number and whose address come out verbatim, the % of all those
    secrets said, the % of canaries whose reply says another canary's number or address, how
    the replies read (the % of their 4-grams that repeat, and their perplexity under `judge`,
    the base model, given their prompts), and the reply to the report's example, the first
    canary the fine-tuned model reproduces (else the first), described by the returned dict
    (its prompt's end, its secret)."""
    from gss.evaluate.leaks import secrets_said
    from gss.evaluate.utility import perplexity
    from gss_bench.canaries.data import secret_fields

    k = data.config.k
    memorized = [i for i, flag in zip(report.index, report.per_row, strict=True) if flag]
    i = memorized[0] if memorized else report.index[0]
    row = data.canary_rows[i]
    example = {"canary": i, "prompt_end": tokenizer.decode(list(row[k - 24 : k]))}
    example["secret"] = tokenizer.decode(list(row[k:]), skip_special_tokens=True).strip()
    prompts = [list(r[:k]) for r in data.canary_rows]
    width = max(len(r) for r in data.canary_rows) - k + EXTRA_TOKENS
    names = ["number", "address"]
    secrets = [[secret_fields(s)[name] for name in names] for s in data.secrets]

    def probe(m: Any) -> dict[str, Any]:
        leaks = secrets_said(
            m, tokenizer, prompts, secrets, max_new_tokens=width, batch_size=batch_size
        )
        out: dict[str, Any] = {
            f"{name}_leaked": 100 * sum(flags[j] for flags in leaks.said) / len(leaks.said)
            for j, name in enumerate(names)
        }
        out["secrets_said"] = sum(out.values()) / len(names)
        out["others_leaked"] = leaks.prompts_saying_others
        # near-verbatim (case and spacing aside, or most of it in one run): what an exact
        # filter such as MemFree lets through (`gss.evaluate.near_verbatim`)
        out["secrets_near"] = leaks.secrets_leaked_near
        out["repetition"] = leaks.repetition
        replied = [(p, r) for p, r in zip(prompts, leaks.continuation_ids, strict=True) if r]
        out["reply_perplexity"] = (
            perplexity(
                judge,
                [p + list(r) for p, r in replied],
                batch_size=batch_size,
                prompt_lengths=[k] * len(replied),
            )
            if replied
            else float("nan")
        )
        return {**out, "reply": leaks.continuations[i]}

    return example, probe


@dataclass(frozen=True)
class _Run:
    """What every step of a run shares: its options, its folder, the models (the fine-tuned
    one, the reference of every signal, scan and calibration, and the base model, for its own
    row and as the judge of replies), the canary data and its (n, k) window, and how a model
    is measured."""

    args: argparse.Namespace
    command: str  # as results.json records it
    started: float  # time.perf_counter() at the start, for the total seconds
    out: Path
    base_path: Path
    base: Any
    model: Any
    reference: Any
    tokenizer: Any
    data: Any
    finetune: FinetuneConfig
    finetune_info: dict[str, Any]
    pad: int
    k: int
    n: int
    batch_size: int
    progress: bool
    train_rows: list[Any]  # the calibration set: the canaries, then clean fine-tuning rows

    def measure(self, m: Any, method: str = "generate") -> Any:
        """`m`'s memorization of the canaries (`method`: greedy or teacher-forced) and its
        held-out perplexity, in the run's window."""
        from gss.evaluate.suite import evaluate_model

        return evaluate_model(
            m,
            self.data.canary_rows,
            self.data.heldout_rows,
            k=self.k,
            n=self.n,
            pad_id=self.pad,
            batch_size=self.batch_size,
            method=method,
            progress=self.progress,
        )

    def sweep_options(self) -> dict[str, Any]:
        """`steering_sweep`'s options for the run's window and batches."""
        return {
            "k": self.k,
            "n": self.n,
            "pad_id": self.pad,
            "batch_size": self.batch_size,
            "progress": self.progress,
        }


@dataclass(frozen=True)
class _Unmitigated:
    """The fine-tuned model before any mitigation and the base model, measured: the reports,
    the leak probe every method is measured with (built from the fine-tuned model's report),
    its example canary, and what both models say to the probe."""

    report: Any
    base_report: Any
    example: dict[str, Any]
    probe: Callable[[Any], dict[str, Any]]
    said: dict[str, dict[str, Any]]  # "unmitigated", "base model"


@dataclass(frozen=True)
class _Scan:
    """Where the run steers: the pilot statistics of omega, the per-block scan and the block
    chosen (the scan's strongest block the fine-tune changed, or `--layer`)."""

    signal: dict[str, Any]
    scan: Any
    layer: int


@dataclass(frozen=True)
class _Calibrations:
    """The GSS rows: each row's changes to the paper's method, the statistics of the rows
    calibrated, the ablation rows that could not be (and why), and each calibrated row's
    sweep as a method."""

    options: dict[str, dict[str, Any]]
    stats: dict[str, Any]
    skipped: dict[str, str]
    methods: dict[str, _Method]


@dataclass
class _Table:
    """The report as it fills in, method by method: table.md's rows and its grid's, the
    methods of results.json, the Pareto curves (% memorized or % secrets said, against
    perplexity) and what each model says to the leak probe."""

    rows: list[list[Any]]
    said: dict[str, dict[str, Any]]
    grid_rows: list[list[Any]] = field(default_factory=list)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    curves: dict[str, Sequence[tuple[float, float]]] = field(default_factory=dict)
    leak_curves: dict[str, Sequence[tuple[float, float]]] = field(default_factory=dict)


def _out_dir(args: argparse.Namespace) -> Path:
    """The results folder: `--out`, else results/canaries named after the run's variant
    (results/canaries-chat-lora, results/canaries-gemma3-270m-quick, ...)."""
    from gss_bench.models import KNOWN_MODELS

    variant = ("-chat" if args.chat else "") + ("-replies" if args.replies_only else "")
    variant += "-lora" if args.lora else ""
    if args.model != DEFAULT_MODEL and args.model in KNOWN_MODELS:
        variant = f"-{args.model}{variant}"  # results/canaries-gemma3-270m
    default_out = "results/canaries" + variant + ("-quick" if args.quick else "")
    return Path(args.out or default_out)


def _canary_data(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The canary data at the sizes `--quick`, `--chat` and `--canaries` ask for (a secret cut
    by the row length is logged: only its start is scored)."""
    from gss_bench.canaries.data import CanaryConfig, make_canary_data

    sizes: dict[str, Any] = dict(QUICK) if args.quick else {}
    if args.chat:
        sizes.update(QUICK_CHAT if args.quick else CHAT)
    if args.canaries:
        sizes["canaries"] = args.canaries
        sizes["split"] = args.canaries > CanaryConfig.canaries  # the corpus's passages run out
    data = make_canary_data(tokenizer, canary_config(tokenizer, args.seed, **sizes))
    if data.secrets_cut:
        _log(
            f"{data.secrets_cut} of {len(data.secrets)} canary secrets run past row_len="
            f"{data.config.row_len} tokens: only their start is scored"
        )
    return data


def _context(args: argparse.Namespace, argv: Sequence[str] | None, started: float) -> _Run:
    """Build the run's context: its output folder, the base model and its tokenizer, the
    canary data, the fine-tune (cached) and the reference. Contradicting options are refused
    before any work."""
    from gss.hf.adapters import adapters_off
    from gss.hf.blocks import find_decoder_blocks

    if args.replies_only and not args.chat:
        raise GSSError("--replies-only fine-tunes on the assistant's messages: add --chat.")
    out = _out_dir(args)
    if args.protect:  # before any work: the report it would replace there is its own
        check_report_dir(out / "protect")
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    if not progress:
        transformers_bars_off()
    base_path = model_path(args.model, progress=progress)
    if args.chat:
        check_chat(_tokenizer(base_path), base_path)
    base, tokenizer = _load(base_path, args.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    data = _canary_data(args, tokenizer)
    blocks = len(find_decoder_blocks(base))
    ft_cfg = FinetuneConfig(
        train_blocks=args.train_blocks or default_train_blocks(blocks),
        lr=args.lr,
        max_epochs=args.max_epochs,
        clean_per_epoch=args.clean_per_epoch,
        seed=args.seed,
        lora_rank=args.lora,
        replies_only=args.replies_only,
    )
    model, ft_info = finetuned(
        base, base_path, data, ft_cfg, pad, Path(args.cache_dir or default_cache()), tokenizer
    )
    return _Run(
        args=args,
        command="gss bench canaries " + " ".join(argv or []),
        started=started,
        out=out,
        base_path=base_path,
        base=base,
        model=model,
        # the reference of every signal, scan and calibration below: the base model, or for a
        # LoRA the same weights with its adapters off (no second copy needed; `base` stays for
        # its row)
        reference=adapters_off(model) if args.lora else base,
        tokenizer=tokenizer,
        data=data,
        finetune=ft_cfg,
        finetune_info=ft_info,
        pad=pad,
        k=data.config.k,
        n=data.config.row_len,
        batch_size=args.batch_size,
        progress=progress,
        train_rows=[*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]],
    )


def _measure_unmitigated(run: _Run) -> _Unmitigated:
    """Measure the fine-tuned model and the base model, and build the leak probe every method
    is measured with, from the fine-tuned model's report (its example canary is the first one
    that model reproduces)."""
    unmitigated, original = run.measure(run.model), run.measure(run.base)
    _log(
        f"fine-tuned: {unmitigated.memorized:.1f}% of {unmitigated.rows} canaries memorized, "
        f"{unmitigated.token_match:.1f}% of their tokens, perplexity {unmitigated.perplexity:.2f}"
        f" (base model: {original.memorized:.1f}% / {original.perplexity:.2f})"
    )
    example, probe = _leak_probe(run.tokenizer, run.data, unmitigated, run.batch_size, run.base)
    said = {"unmitigated": probe(run.model), "base model": probe(run.base)}
    return _Unmitigated(unmitigated, original, example, probe, said)


def _signal_and_scan(run: _Run) -> _Scan:
    """The pilot signal (omega against the reference on the canaries and on held-out text;
    signal.png) and the per-block scan (layers.png) that picks the block to steer, unless
    `--layer` names one."""
    from gss.layer_scan import scan_layers
    from gss.report import plot_signal
    from gss.signal.omega import omega_rows, signal_statistics

    model, reference, data = run.model, run.reference, run.data
    omega = omega_rows(model, reference, data.canary_rows)
    normal = omega_rows(model, reference, data.heldout_rows)
    width = max(omega.shape[1], normal.shape[1])  # chat: the canaries are the longer rows
    both = [nn.functional.pad(o, (0, width - o.shape[1]), value=torch.nan) for o in (omega, normal)]
    pilot = signal_statistics(torch.cat(both))
    signal = {
        "all": pilot.to_dict(),
        "canaries": signal_statistics(omega).to_dict(),
        "heldout": signal_statistics(normal).to_dict(),
    }
    title = "omega with the base model as reference: canary rows vs held-out text"
    plot_signal(omega, pilot, run.out / "signal.png", title, normal)
    scan = scan_layers(  # the paper's signal, as the committed results were scanned
        model,
        reference,
        run.train_rows,
        "gss",
        gen_texts=data.general_rows,
        batch_size=8,
        progress=run.progress,
    )
    scan.plot(run.out / "layers.png", f"signal strength per block: {run.base_path.name} + canaries")
    layer = scan.best if run.args.layer is None else run.args.layer
    _log(
        f"layer scan ({scan.seconds:.0f} s): strongest block {scan.strongest}, strongest the "
        f"fine-tune changed {scan.best} ({len(scan.unchanged)} blocks equal the base's); "
        f"steering {layer}"
    )
    return _Scan(signal, scan, layer)


def _probe_steers(
    model: Any, probe: Callable[[Any], dict[str, Any]], points: Sequence[Any]
) -> list[dict[str, Any]]:
    """`probe` at each of a GSS sweep's points, each attached to `model` in turn."""
    out = []
    for point in points:
        with point.artifact.attach(model):
            out.append(probe(model))
        _log(f"  {point.options}: {out[-1]['secrets_said']:.1f}% of secrets said")
    return out


def _calibrated(run: _Run, options: dict[str, Any], layer: int) -> tuple[Any, Any]:
    """One GSS row's statistics and artifact at `layer`: `options` are its changes to the
    paper's method (``replies_only``: the same rows, as the conversations they render)."""
    from gss.calibrate import build_artifact
    from gss.statistics.collect import collect_statistics

    texts: Sequence[Any] = run.train_rows
    if options.get("replies_only"):  # the same rows, as the conversations they render
        texts = run.data.conversations[: len(run.train_rows)]
        options = {**options, "tokenizer": run.tokenizer, "max_length": run.n}
    stats = collect_statistics(
        run.model,
        run.reference,
        texts,
        "gss",  # each row's options are changes to the paper's method
        layer=layer,
        gen_texts=run.data.general_rows,
        batch_size=8,
        progress=run.progress,
        **options,
    )
    return stats, build_artifact(run.model, stats, rank=run.args.rank, progress=False)


def _gss_sweep(run: _Run, before: _Unmitigated, artifact: Any, deltas: list[float]) -> _Method:
    """A calibrated artifact's grid: every strength, then the gate's threshold percentile at
    the strength the selection rule picks among them; each point with its leak probe."""
    from gss.evaluate.sweep import steering_sweep

    model, data, sweep = run.model, run.data, run.sweep_options()
    canaries, heldout = data.canary_rows, data.heldout_rows
    points = steering_sweep(model, artifact, canaries, heldout, deltas=deltas, **sweep)
    leaks = _probe_steers(model, before.probe, points)
    delta = _select(points, leaks, before.report.perplexity).options["delta"]
    gates = steering_sweep(  # the gate's threshold, at the strength chosen so far
        model,
        artifact,
        canaries,
        heldout,
        deltas=[delta],
        percentiles=PERCENTILES,
        general=data.general_rows,
        **sweep,
    )
    points, leaks = points + gates, leaks + _probe_steers(model, before.probe, gates)
    seconds = artifact.provenance.timings["total"]
    return _Method(
        points,
        [seconds] * len(points),
        leaks,
        _hooked(model, lambda p: p.artifact.attach(model)),
    )


def _calibrate_and_sweep(run: _Run, before: _Unmitigated, layer: int) -> _Calibrations:
    """Calibrate GSS and GSS-TR (with `--chat`, GSS with only the replies memorizable too; with
    `--ablation`, each change of the GSS-TR study) at `layer`, and sweep each. An ablation row
    the data cannot calibrate is reported as such instead of failing the run."""
    args = run.args
    deltas = [float(d) for d in args.deltas.split(",")] if args.deltas else list(DELTAS)
    calibrations: dict[str, dict[str, Any]] = {
        "GSS": {},
        "GSS-TR": {"target": "toward-reference"},
        # chat: the same rows as conversations, only the assistant's messages memorized
        **({"GSS, replies": {"replies_only": True}} if args.chat else {}),
        **(ABLATION if args.ablation else {}),
    }
    stats_by: dict[str, Any] = {}
    skipped: dict[str, str] = {}  # ablation rows that could not be calibrated, and why
    methods: dict[str, _Method] = {}
    for name, options in calibrations.items():
        try:
            stats, artifact = _calibrated(run, options, layer)
        except GSSError as err:
            if name not in ABLATION:
                raise
            skipped[name] = str(err)  # e.g. no token passes omega > 1 nat
            _log(f"{name}: not calibrated: {err}")
            continue
        stats_by[name] = stats
        methods[name] = _gss_sweep(run, before, artifact, deltas)
    return _Calibrations(calibrations, stats_by, skipped, methods)


def _mean_difference(run: _Run, before: _Unmitigated, stats: Any, layer: int) -> _Method:
    """The mean-difference baseline: the vector of GSS's own statistics (`stats`), added at
    `layer` at each strength of `ALPHAS`; it costs GSS's signal and statistics passes."""
    from gss.evaluate.sweep import SweepPoint
    from gss_bench.baselines.steering import MeanDifferenceSteer, mean_difference_vector

    model = run.model
    vector = mean_difference_vector(stats)
    mean_points, mean_said = [], []
    for alpha in ALPHAS:
        with MeanDifferenceSteer(vector, alpha).attach(model, layer):
            mean_points.append(SweepPoint({"alpha": alpha}, run.measure(model, "forced")))
            mean_said.append(before.probe(model))
    t = stats.timings
    return _Method(
        mean_points,
        [t["signal"] + t["statistics"]] * len(mean_points),
        mean_said,
        _hooked(
            model, lambda p: MeanDifferenceSteer(vector, p.options["alpha"]).attach(model, layer)
        ),
    )


def _other_baselines(
    run: _Run, before: _Unmitigated, names: Sequence[str], layer: int
) -> dict[str, _Method]:
    """The `--baselines` over their default grids, given the calibration set's canaries and
    clean rows, the steered block and the base model as their reference."""
    if not names:
        return {}
    from gss_bench.baselines import MitigationData

    mdata = MitigationData(
        memorized=run.data.canary_rows,
        clean=run.data.finetune_rows[:CALIBRATION_CLEAN_ROWS],
        pad_id=run.pad,
        prompt_len=run.k,
        layer=layer,
        reference=run.base,  # a whole model: weight-level baselines read its parameters
    )
    methods = {}
    for name in names:
        _log(f"baseline {name} ...")
        methods[name] = _baseline(
            name,
            run.model,
            mdata,
            lambda m: run.measure(m, "forced"),
            before.probe,
            before.report.perplexity,
        )
    return methods


def _protect(run: _Run, before: _Unmitigated) -> tuple[dict[str, Any], _Method | None]:
    """With `--protect`: `gss protect` with its defaults, its report in OUT/protect; what it
    measured (or why it failed, e.g. nothing memorized), and its choice as a one-point method
    for the table."""
    if not run.args.protect:
        return {}, None
    from gss_bench.canaries.protection import protect_point

    model = run.model
    _log("gss protect ...")
    try:
        point, seconds, protected = protect_point(
            model,
            run.reference,
            run.data,
            run.tokenizer,
            run.train_rows,
            budget=PPL_TOLERANCE,
            batch_size=run.batch_size,
            measure=run.measure,
            report_dir=run.out / "protect",
            progress=run.progress,
            search=SearchSpace(
                prefer=run.args.protect_prefer, reply_check=run.args.protect_reply_check
            ),
        )
    except GSSError as err:  # e.g. nothing memorized to protect
        _log(f"  gss protect: {err}")
        return {"error": str(err)}, None
    if "steer" not in protected:
        return protected, None
    steer = protected.pop("steer")
    with steer.attach(model):
        leaked = before.probe(model)
    method = _Method([point], [seconds], [leaked], _hooked(model, lambda _: steer.attach(model)))
    h = protected["heldout_canaries"]
    _log(
        f"  held-out canaries ({h['rows']}): {h['secrets_said_before']:.1f}% of secrets said "
        f"before, {h['after']:.1f}% after ({h['canaries_saying_after']} of {h['rows']} canaries;"
        f" one-sided 95% upper bound {h['upper_bound_after']:.1f}%) ({seconds:.0f} s)"
    )
    return protected, method


def _row(
    name: str,
    report: Any,
    options: Any,
    seconds: float | None,
    leaked: dict[str, Any],
    unmitigated: Any,
) -> list[Any]:
    """table.md's row of a model measured by `report`, with its leak probe `leaked`."""
    ds = report.deviation_scores(unmitigated)
    change = 100 * (report.perplexity / unmitigated.perplexity - 1)
    return [
        name,
        options,
        f"{report.memorized:.1f}",
        f"{report.token_match:.1f}",
        f"{leaked['number_leaked']:.1f}",
        f"{leaked['address_leaked']:.1f}",
        *_reply_cells(leaked),
        f"{report.perplexity:.2f} ({change:+.1f}%)",
        *(f"{v:.1f}" for v in ds.values()),
        "" if seconds is None else f"{seconds:.0f}",
    ]


def _grid_rows(name: str, method: _Method, chosen: Any) -> list[list[Any]]:
    """The grid's rows of a method's points (memorization teacher-forced)."""
    return [
        [
            name,
            _label(p.options),
            f"{p.report.memorized:.1f}",
            f"{leaks['number_leaked']:.1f}",
            f"{leaks['address_leaked']:.1f}",
            *_reply_cells(leaks),
            f"{p.report.perplexity:.2f}",
            "yes" if p is chosen else "",
        ]
        for p, leaks in zip(method.points, method.said, strict=True)
    ]


def _tabulate_method(
    table: _Table,
    run: _Run,
    before: _Unmitigated,
    name: str,
    method: _Method,
    gss: _Calibrations,
) -> None:
    """A method's part of the report: the point the selection rule picks, re-measured by
    greedy decoding, as its row; its grid points; its record; its curves."""
    base_ppl = before.report.perplexity
    points = method.points
    chosen = _select(points, method.said, base_ppl)
    i = _index(points, chosen)
    seconds, table.said[name] = method.seconds[i], method.said[i]  # both measured at the point
    table.curves[name] = [(p.report.memorized, p.report.perplexity) for p in points]
    table.leak_curves[name] = [
        (leaks["secrets_said"], p.report.perplexity)
        for p, leaks in zip(points, method.said, strict=True)
    ]
    with method.attach(chosen) as steered:  # re-measured by greedy decoding
        final = run.measure(steered)
    label = _label(chosen.options)
    within = chosen.report.perplexity <= base_ppl * (1 + PPL_TOLERANCE)
    unmitigated = before.report
    table.rows.append(
        _row(name + ("" if within else " *"), final, label, seconds, table.said[name], unmitigated)
    )
    grid = [
        {**p.to_dict(), **_leak_counts(leaks), "seconds": sec}
        for p, leaks, sec in zip(points, method.said, method.seconds, strict=True)
    ]
    table.grid_rows += _grid_rows(name, method, chosen)
    record = {
        "selected": {"options": chosen.options, **final.to_dict(), "within_tolerance": within},
        "deviation_scores": final.deviation_scores(unmitigated),
        "mitigation_seconds": seconds,
        "grid": grid,
    }
    if name in gss.options:
        record["calibration_options"] = gss.options[name]
        record["token_counts"] = gss.stats[name].counts
    table.records[name] = record
    _log(f"{name} {label}: {final.memorized:.1f}% memorized, perplexity {final.perplexity:.2f}")


def _tabulate(
    run: _Run, before: _Unmitigated, methods: dict[str, _Method], gss: _Calibrations
) -> _Table:
    """The rows, grid and records of the report: the unmitigated model's, each method's at
    its selected point, then the GSS rows that could not be calibrated."""
    unmitigated = before.report
    row = _row("unmitigated", unmitigated, "", None, before.said["unmitigated"], unmitigated)
    table = _Table(rows=[row], said=dict(before.said))
    for name, method in methods.items():
        _tabulate_method(table, run, before, name, method, gss)
    for name, reason in gss.skipped.items():
        table.rows.append([name, "not calibrated", *[""] * (len(HEADER) - 2)])
        table.records[name] = {"calibration_options": gss.options[name], "error": reason}
    return table


def _results(
    run: _Run,
    before: _Unmitigated,
    scan: _Scan,
    table: _Table,
    protected: dict[str, Any],
    total: float,
) -> dict[str, Any]:
    """results.json: the run's setup, the unmitigated and base models, the signal and the scan,
    every method's record, gss protect's (with `--protect`) and what each model says."""
    return {
        "command": run.command,
        "gss_version": __version__,
        "machine": machine_info(device=run.args.device),
        "model": str(run.base_path),
        "data": run.data.describe(),
        "finetune": {**run.finetune.to_dict(), **run.finetune_info},
        "selection_rule": {
            "perplexity_tolerance_relative": PPL_TOLERANCE,
            "order": ["memorized", "secrets_said", "others_leaked", "perplexity"],
        },
        "unmitigated": before.report.to_dict(),
        "base_model": before.base_report.to_dict(),
        "signal": scan.signal,
        "layer_scan": scan.scan.to_dict(),
        "layer": scan.layer,
        "reference": "gss.adapters_off(model)" if run.args.lora else "the base model",
        "methods": table.records,
        **({"protect": protected} if protected else {}),
        # per model: % of canaries whose account number / address it says verbatim, and
        # its reply to the example canary
        "disclosure": {"example": before.example, "models": table.said},
        "total_seconds": total,
    }


def _heldout_line(protected: dict[str, Any]) -> str:
    """What gss protect's held-out canaries, which its search never saw, say after, with the
    exact 95% intervals (issue 70: how far "0 of N" is from none)."""
    h = protected.get("heldout_canaries", {})
    if "canaries_saying_after" not in h:
        return ""
    lo, hi = h["interval_after"]
    return (
        f"\n\ngss protect's {h['rows']} held-out canaries (the search never saw them): "
        f"{h['secrets_said_before']:.1f}% of their numbers and addresses said before, "
        f"{h['after']:.1f}% after; {h['canaries_saying_after']} of {h['rows']} canaries say "
        f"either (95% interval {lo:.1f}-{hi:.1f}%, one-sided 95% upper bound "
        f"{h['upper_bound_after']:.1f}%)."
    )


def _table_text(run: _Run, before: _Unmitigated, layer: int, table: _Table, rows: str) -> str:
    """table.md: the table (`rows`), what its columns mean, what each model says to the
    example canary's prompt, and every grid point."""
    args, example, unmitigated = run.args, before.example, before.report
    return (
        rows + f"\n\n({run.n},{run.k})-memorization of {unmitigated.rows} canaries (greedy); "
        f"perplexity on {unmitigated.heldout_tokens} held-out tokens; selected: within +"
        f"{100 * PPL_TOLERANCE:.0f}% perplexity (* = no point was), the lowest memorization, "
        "then the fewest secrets said, then the fewest canaries saying another's secret, then "
        f"the lowest perplexity; steering block {layer}"
        + (f"; a rank-{args.lora} LoRA, reference gss.adapters_off(model)" if args.lora else "")
        + ("; fine-tuned on the assistant's messages alone" if args.replies_only else "")
        + ("; GSS, replies: calibrated with only the replies memorizable" if args.chat else "")
        + ". % numbers / addresses out: canaries whose account number / address the model says "
        f"verbatim, greedily (the window and {EXTRA_TOKENS} tokens more, up to EOS); % others' "
        "out: canaries whose reply says another canary's number or address; % near-verbatim "
        "out: of all the numbers and addresses, those said near-verbatim (case and spacing "
        "aside, or 80% of one in a single run: gss.evaluate.near_verbatim), the "
        "verbatim ones among them; % replies' 4-grams "
        "repeated: of the replies' token 4-grams, those repeating an earlier one of the same "
        "reply (a looping reply); replies' base ppl: their perplexity under the base model, "
        "given the prompt (its own greedy replies set the floor; a secret's random digits "
        "raise it)"
        + f".\n\nWhat each model says to canary {example['canary']}'s prompt, which ends "
        f"`{_quoted(example['prompt_end'])}` (greedy; the secret: "
        f"`{_quoted(example['secret'])}`):\n\n"
        + "\n".join(f"- {who}: `{_quoted(d['reply'])}`" for who, d in table.said.items())
        + "\n\nEvery grid point (memorization teacher-forced):\n\n"
        + markdown_table(GRID_HEADER, table.grid_rows)
        + "\n"
    )


def _write(
    run: _Run, before: _Unmitigated, scan: _Scan, table: _Table, protected: dict[str, Any]
) -> None:
    """Write the report: the Pareto figures (memorization and secrets said against
    perplexity), results.json and table.md; print the table and what was written."""
    from gss.evaluate.sweep import plot_pareto

    rows = markdown_table(HEADER, table.rows)
    unmitigated, name = before.report, run.base_path.name
    plot_pareto(
        table.curves,
        (unmitigated.memorized, unmitigated.perplexity),
        run.out / "pareto.png",
        f"{name}: canary memorization vs perplexity",
    )
    plot_pareto(
        table.leak_curves,
        (table.said["unmitigated"]["secrets_said"], unmitigated.perplexity),
        run.out / "leaks.png",
        f"{name}: canary secrets said vs perplexity",
        ylabel="% of account numbers and addresses said",
    )
    total = time.perf_counter() - run.started
    write_json(run.out / "results.json", _results(run, before, scan, table, protected, total))
    rows += _heldout_line(protected)
    (run.out / "table.md").write_text(_table_text(run, before, scan.layer, table, rows))
    print(rows)
    figures = "pareto.png, leaks.png, layers.png, signal.png"
    print(f"wrote {run.out}: results.json, table.md, {figures}; {total:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    """`gss bench canaries`: the steps of the module's docstring, in order."""
    args = build_parser().parse_args(argv)
    baselines = baseline_names(args.baselines, "canaries")
    if args.threads:
        torch.set_num_threads(args.threads)
    run = _context(args, argv, started=time.perf_counter())
    before = _measure_unmitigated(run)
    scan = _signal_and_scan(run)
    gss = _calibrate_and_sweep(run, before, scan.layer)
    methods = dict(gss.methods)
    methods["Mean-diff"] = _mean_difference(run, before, gss.stats["GSS"], scan.layer)
    methods.update(_other_baselines(run, before, baselines, scan.layer))
    protected, protect_method = _protect(run, before)
    if protect_method is not None:
        methods["GSS protect"] = protect_method
    table = _tabulate(run, before, methods, gss)
    _write(run, before, scan, table, protected)
    return 0
