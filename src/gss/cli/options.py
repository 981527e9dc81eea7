"""The ``gss`` commands' shared options, and the parsing of the values they take.

Several commands take the same options (the model and how it loads, the reference, the data,
batching, the (n, k) window); they are declared here once, so that they read and behave the
same in every command. The calibration options are `gss.config.CalibrationConfig`'s fields
themselves: each flag takes its field's type, choices, help and default (`add_config_args`),
so a field added to the config is a flag of `gss calibrate` with nothing written here.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gss.config import (
    DEFAULT_PRESET,
    DEFAULT_WINDOW,
    INSTEAD_OF,
    PRESETS,
    CalibrationConfig,
    RunOptions,
    Window,
    field_names,
)
from gss.errors import GSSError
from gss.hf.loading import ADAPTERS_OFF, DEFAULT_MAX_LENGTH
from gss.hf.quantization import QUANTO

DATA_HELP = (
    ".txt (one sequence a line) or .jsonl (rows with 'text', or 'messages' (rendered with the "
    "chat template), or 'prompt' and 'completion'); with the datasets extra also .parquet, "
    ".csv, .json, .arrow, a save_to_disk directory or a Hub dataset id (--split, --text-column)"
)
HUB_ID = "or a Hub repo id org/name (from the local Hub cache with HF_HUB_OFFLINE=1)"
# The fields `gss layers` reads (`gss.scan_layers`).
SCAN_FIELDS = ("omega_threshold", "replies_only", "target", "block_path")

# Where a flag is added: a command's parser, or one of its argument groups (the sections of
# its --help); the helpers below take either.
Flags = argparse._ActionsContainer
if TYPE_CHECKING:
    from gss.cli.parser import Parser

    Commands = argparse._SubParsersAction[Parser]  # `gss`'s subcommands


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default in its help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


def add_command(
    sub: Commands, name: str, summary: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """The subcommand ``name`` of `gss` (``summary``: its line in ``gss --help`` and its
    description), running ``func``; its flags are added to what this returns."""
    p = sub.add_parser(
        name,
        help=summary,
        description=summary,
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # an abbreviated flag must not stand for another one
    )
    p.set_defaults(func=func)
    return p


def add_groups(p: argparse.ArgumentParser, *titles: str) -> list[Flags]:
    """Argument groups of ``p`` titled ``titles``: the sections of its --help, in that order."""
    return [p.add_argument_group(title) for title in titles]


def add_model_args(p: Flags, reference: bool = False, run: Flags | None = None) -> None:
    """The fine-tuned model, where it runs and how it loads (`gss.hf.loading.load_model`);
    ``reference``: the command loads a reference model the same way; ``run``: where
    ``--no-progress`` goes (default: with the others)."""
    both = "the model and the reference" if reference else "the model"
    p.add_argument(
        "--model",
        required=True,
        help="the fine-tuned model: its directory, or a Hub repo id org/name (through the Hub "
        "cache; from the cache alone with HF_HUB_OFFLINE=1)",
    )
    p.add_argument(
        "--model-revision",
        metavar="REV",
        help="with a Hub repo id for --model: its branch, tag or commit",
    )
    p.add_argument(
        "--device", help="torch device, e.g. cpu, cuda or cuda:1 (default: cpu; or --device-map)"
    )
    p.add_argument(
        "--device-map",
        metavar="MAP",
        help=f"place {both} with accelerate instead of --device: auto, "
        'a device, or a JSON object of module placements, e.g. \'{"model.layers.0": 0, '
        '"lm_head": "cpu"}\'',
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the weights are loaded in (quantized: of the layers left unquantized)",
    )
    quantized = p.add_mutually_exclusive_group()
    quantized.add_argument(
        "--quantization",
        choices=list(QUANTO),
        help=f"load {both} with weight-only quantization by "
        "optimum-quanto, on a CPU or a GPU (pip install 'gated-subspace-steering[quant]')",
    )
    quantized.add_argument(
        "--load-in-8bit",
        dest="quantization",
        action="store_const",
        const="bnb-8bit",
        help="load in 8 bits with bitsandbytes (a CUDA GPU only)",
    )
    quantized.add_argument(
        "--load-in-4bit",
        dest="quantization",
        action="store_const",
        const="bnb-4bit",
        help="load in 4 bits (NF4) with bitsandbytes (a CUDA GPU only)",
    )
    (run or p).add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (transformers' weight loading included), e.g. in logs",
    )


def add_out_args(p: Flags, what: str, required: bool = False) -> None:
    """``--out`` (``what`` it holds) and ``--overwrite``: results are never replaced unasked."""
    p.add_argument("--out", type=directory, required=required, help=what)
    p.add_argument(
        "--overwrite", action="store_true", help="replace what an earlier run wrote in --out"
    )


def add_reference_arg(p: Flags) -> None:
    """The reference model (`gss.hf.loading.load_reference`)."""
    p.add_argument(
        "--reference",
        required=True,
        help=f"the reference model: its directory or Hub repo id (loaded as --model is), or "
        f"{ADAPTERS_OFF} when --model is a PEFT adapter: its base model with the adapters "
        "switched off",
    )
    p.add_argument(
        "--reference-revision",
        metavar="REV",
        help="with a Hub repo id for --reference: its branch, tag or commit",
    )


def add_config_args(
    p: Flags,
    names: Sequence[str],
    required: Sequence[str] = (),
    groups: Mapping[str, Flags] | None = None,
) -> None:
    """One flag per `CalibrationConfig` field in ``names``: its type, choices, help and default
    are the field's own. A flag not given is absent from the parsed arguments, so the preset
    (or the config's default) decides it (`config_overrides`). ``groups``: where a field's
    flag goes, by field name (default, and for a field it does not name: ``p``)."""
    hints = typing.get_type_hints(CalibrationConfig)
    defaults = PRESETS[DEFAULT_PRESET]  # what a flag left out takes, with --preset's default
    fields = {f.name: f for f in dataclasses.fields(CalibrationConfig)}
    for name in names:
        f, kind = fields[name], hints[name]
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        hidden = name in required or default is None or default is False  # nothing to show
        others = [
            f"; --preset {preset}: {getattr(config, name)}"
            for preset, config in PRESETS.items()
            if getattr(config, name) != default
        ]
        shown = "" if hidden else f" (default: {default}{''.join(others)})"
        options: dict[str, Any] = {"help": f.metadata["help"] + shown, "dest": name}
        if name in required:
            options["required"] = True
        else:
            options["default"] = argparse.SUPPRESS
        if f.metadata.get("choices"):
            options["choices"] = f.metadata["choices"]
        elif kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            inner = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
            options["type"] = inner[0]
        (groups or {}).get(name, p).add_argument(flag, **options)


def add_preset_arg(p: Flags) -> None:
    """The named config whose fields the flags given override."""
    p.add_argument(
        "--preset",
        "--variant",
        default=DEFAULT_PRESET,
        choices=list(PRESETS),
        help="named config: gss-tr (ours, the default: it measured best) or gss (the paper); "
        "flags given override its fields",
    )


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `CalibrationConfig` fields given as flags; two flags of which one would be ignored
    are refused."""
    given = {name: getattr(args, name) for name in field_names() if hasattr(args, name)}
    for name, other in INSTEAD_OF.items():
        if name in given and other in given:
            raise GSSError(
                f"--{_flag(name)} replaces --{_flag(other)}'s rule, and both were given: keep one."
            )
    if "ridge_delta" in given and given.get("coefficient") != "ridge":
        raise GSSError(
            "--ridge-delta sets the ridge coefficient's regulariser: give --coefficient ridge "
            "with it, or leave it out."
        )
    return given


def _flag(name: str) -> str:
    return name.replace("_", "-")


def add_batch_args(
    p: Flags, batch_size: int = RunOptions.batch_size, length_help: str = "tokens kept per text"
) -> None:
    """Texts per forward pass and tokens kept per text (`gss.hf.loading.default_max_length`
    when not given)."""
    p.add_argument(
        "--batch-size", type=positive_int, default=batch_size, help="texts per forward pass"
    )
    p.add_argument(
        "--max-length",
        type=positive_int,
        help=f"{length_help} (default: {DEFAULT_MAX_LENGTH}, or the model's context if shorter)",
    )


def add_data_args(p: Flags, main: str = "--data") -> None:
    """Which split and which columns the command's data options read (`gss.data_sources`):
    the columns must be in ``main``; the other data options use them where they have them."""
    p.add_argument(
        "--split",
        help="the split of a Hub dataset, a dataset folder or a saved DatasetDict, for every "
        "data option (default: train; a Hub dataset also takes slices, e.g. 'train[:1000]')",
    )
    columns = {
        "text": "the column holding the text (a string)",
        "messages": "the column holding the conversation (a list of {'role', 'content'})",
        "prompt": "the column holding the prompt (with --completion-column)",
        "completion": "the column holding the completion (with --prompt-column)",
    }
    for kind, what in columns.items():
        p.add_argument(
            f"--{kind}-column",
            metavar="NAME",
            help=f"{what}, in {main}'s rows; the other data options read it where they have it",
        )


def data_columns(args: argparse.Namespace) -> dict[str, str | None]:
    """The ``--split`` and column options, as `gss.data_sources.read_data`'s keywords."""
    names = ("split", "text_column", "messages_column", "prompt_column", "completion_column")
    return {name: getattr(args, name, None) for name in names}


def add_window_args(p: Flags, rows: str = "--data") -> None:
    """What `gss evaluate`, `sweep`, `audit` and `protect` prompt with and match; ``rows``:
    the flag of the rows matched."""
    for f in dataclasses.fields(Window):  # each default and help written once, in `Window`
        p.add_argument(
            f"--{f.name}",
            type=positive_int,
            default=getattr(DEFAULT_WINDOW, f.name),
            help=f.metadata["help"],
        )
    p.add_argument(
        "--reply",
        action="store_true",
        help=f"the rows of {rows} are conversations (rows with 'messages', the last message "
        "the assistant's) or 'prompt' and 'completion' rows: prompt with everything before the "
        "reply (through the chat template, up to the assistant's turn) and match the reply's "
        "first n - k tokens",
    )


def add_prefix_args(p: Flags) -> None:
    """`gss audit`'s and `protect`'s shorter prompts: where a short row's record starts before
    token k, a prompt that ends before it (issue 72)."""
    p.add_argument(
        "--prefixes",
        metavar="P,P,...",
        help="prompt lengths each row is also scored from, each followed by n - k tokens (to "
        "the row's end, windows of 16 or more); k is always scored (default: k and its halves "
        "down to 8, e.g. 8,16,32 at --k 32); not with --reply, whose prompt is the conversation",
    )
    p.add_argument(
        "--memorized-from",
        choices=("k", "shortest"),
        default="k",
        help="a row is memorized when greedy decoding reproduces its window and the "
        "reference's does not: from its first k tokens (k, the paper's (n, k)) or from the "
        "shortest of --prefixes that does (shortest; protect then tunes on and measures each "
        "row from there)",
    )


def parse_prefixes(text: str | None) -> list[int] | None:
    """``--prefixes``: comma-separated prompt lengths, or None when not given."""
    if text is None:
        return None
    values = _ints(text)
    if not values:
        raise GSSError(
            f"--prefixes takes comma-separated prompt lengths, e.g. 8,16,32; got {text!r}."
        )
    return values


def _ints(text: str) -> list[int]:
    """The comma-separated integers of ``text``; empty when it lists none or another word."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return []


def parse_floats(text: str | None, flag: str) -> list[float] | None:
    """A comma-separated list of numbers (``flag``'s value), or None when not given."""
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GSSError(f"{flag} takes comma-separated numbers, got {text!r}.") from None
    if not values:
        raise GSSError(f"{flag} lists no numbers: give comma-separated numbers, e.g. 1,4.")
    return values


def parse_layers(text: str) -> list[int] | None:
    """``--layers``: None for 'all', else the block indices listed."""
    if text == "all":
        return None
    layers = _ints(text)
    if not layers:
        raise GSSError(f"--layers takes 'all' or block indices like 4,8,12; got {text!r}.")
    return layers


def directory(text: str) -> str:
    """An argparse type: a path that is not empty (an empty one would mean the current
    directory to some writers and no output to others)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a directory")
    return text


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, refused in one line otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 1..65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535, got {value}")
    return value
