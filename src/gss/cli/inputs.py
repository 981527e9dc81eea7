"""What several commands read the same way: --model and --reference (with --device,
--device-map, the quantization), the data options, the calibration options and --delta; each
checked before any model loads, its message naming the flag."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

from gss.artifact.files import check_outputs
from gss.cli.options import config_overrides, data_columns
from gss.errors import GSSError, GSSWarning
from gss.hf.loading import default_max_length, load_model, load_reference, parse_device_map


def same_source(a: str, b: str) -> bool:
    """Two data options naming one source: the same string, paths to the same file, or two
    files with the same bytes (a copy)."""
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    if not (pa.is_file() and pb.is_file()):
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    if pa.resolve() == pb.resolve():
        return True
    return pa.stat().st_size == pb.stat().st_size and pa.read_bytes() == pb.read_bytes()


def warn_same_source(args: argparse.Namespace, flag: str, other: str, why: str) -> None:
    """Warn where data option ``flag`` names the same file as ``other`` (``--heldout`` the
    memorized rows, say): ``why`` says what the result then measures."""
    a, b = getattr(args, flag[2:].replace("-", "_")), getattr(args, other[2:].replace("-", "_"))
    if a is not None and b is not None and same_source(a, b):
        warnings.warn(f"{flag} {a} is {other}: {why}", GSSWarning, stacklevel=3)


def _loading(args: argparse.Namespace) -> dict[str, Any]:
    """How --model and --reference load: --device or --device-map, --dtype, the quantization
    (`gss.hf.loading.load_weights`)."""
    device_map = getattr(args, "device_map", None)
    return {
        "device": args.device,
        "dtype": args.dtype,
        "device_map": parse_device_map(device_map) if device_map is not None else None,
        "quantization": getattr(args, "quantization", None),
    }


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    """--model (a directory or a Hub id at --model-revision) and its tokenizer; ``args.device``
    becomes where its inputs go (under --device-map: its input embeddings' device)."""
    from gss.hf.forward import model_device

    loading = _loading(args)
    revision = getattr(args, "model_revision", None)
    model, tokenizer = load_model(args.model, revision=revision, **loading)
    if args.device is None:
        args.device = str(model_device(model))
    return model, tokenizer


def check_local_paths(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """A missing or non-model local directory in any of ``flags`` fails before any model loads
    (a Hub id: its config fetched or found in the cache), its message naming the flag."""
    from gss.hf.hub import hub_id, resolve
    from gss.hf.loading import ADAPTERS_OFF, local_dir

    for flag in flags:
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if path == ADAPTERS_OFF:
            continue
        try:
            if hub_id(path) is None:
                local_dir(path)
            else:  # its config fetched (or found in the cache) now, not after --model loads
                revision = getattr(args, f"{flag.lstrip('-').replace('-', '_')}_revision", None)
                resolve(path, revision)
        except GSSError as err:
            raise GSSError(f"{flag}: {err}") from None


def check_against_config(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> None:
    """What --model's config.json already tells, said before any weights load: a --layer past
    its blocks, a --rank past its hidden size, a --n past its context. A config that does
    not load here (a Hub id, remote code) is left to the checks after loading."""
    config = _local_config(args.model)
    if config is None:
        return
    text = getattr(config, "get_text_config", lambda: config)()
    blocks = getattr(text, "num_hidden_layers", None)
    width = getattr(text, "hidden_size", None)
    context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    given = overrides or {}
    layer, rank = given.get("layer"), given.get("rank")
    if isinstance(blocks, int) and isinstance(layer, int) and not -blocks <= layer < blocks:
        raise GSSError(
            f"--layer: layer {layer} is out of range: {args.model} has {blocks} decoder blocks "
            f"(0..{blocks - 1}, or -{blocks}..-1 from the end)."
        )
    if isinstance(width, int) and isinstance(rank, int) and rank > width:
        raise GSSError(
            f"--rank: rank must be at most the hidden size of {args.model} ({width}), got {rank}."
        )
    n = getattr(args, "n", None)
    if isinstance(context, int) and isinstance(n, int) and n > context:
        raise GSSError(
            f"--n: n = {n} passes the model's context ({context} positions): lower n (--n) "
            f"to {context} or less."
        )


def config_stand_in(path: str) -> Any:
    """A weightless module holding the local model's config: what `check_sequences` and
    `context_length` read (context, vocabulary), so that inputs are checked before the weights
    load. None where no local config reads (a Hub id, remote code: checked after loading)."""
    from torch import nn

    config = _local_config(path)
    if config is None:
        return None
    holder = nn.Module()
    holder.config = config
    return holder


def _local_config(path: str) -> Any:
    """The transformers config of a local model directory (never fetched, no code run), or
    None where there is none to read here."""
    from transformers import AutoConfig

    from gss.hf.loading import NO_CODE

    if not (Path(path) / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, **NO_CODE)
    except Exception:  # unreadable or unknown: the load says what is wrong, in its words
        return None


def load_models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """--model, its tokenizer and --reference; --max-length resolved."""
    check_local_paths(args, ("--model", "--reference"))
    loading = _loading(args)
    model, tokenizer = load_model_and_tokenizer(args)
    resolve_max_length(args, model)
    revision = getattr(args, "reference_revision", None)
    ref = load_reference(args.reference, model, tokenizer, revision=revision, **loading)
    return model, tokenizer, ref


def load_reference_flag(args: argparse.Namespace, flag: str, model: Any, tokenizer: Any) -> Any:
    """The reference model named by ``flag`` (as --reference loads), after --model."""
    revision = getattr(args, "reference_revision", None)
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    return load_reference(value, model, tokenizer, revision=revision, **_loading(args))


def resolve_max_length(args: argparse.Namespace, model: Any) -> None:
    """--max-length as given, else 512 tokens or the model's context if shorter."""
    if args.max_length is None:
        args.max_length = default_max_length(model)


def config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The calibration options given as flags, every one checked (with --preset and
    --max-length) before any model loads."""
    from gss.config import resolve

    overrides = config_overrides(args)
    given_length = {} if args.max_length is None else {"max_length": args.max_length}
    resolve(args.preset, {**overrides, **given_length})
    return overrides


def read_rows(
    args: argparse.Namespace, flag: str, main: bool = False, keep_rows: bool = True
) -> Any:
    """The rows of the data option ``flag`` (`gss.data_sources.read_data`), with --split and
    the column options: ``main`` (--data, --memorized) must have the columns named, the others
    use them where they have them. An error names the flag."""
    from gss.data_sources import read_data

    value = getattr(args, flag[2:].replace("-", "_"))
    progress = not getattr(args, "no_progress", False)
    columns = data_columns(args)
    try:
        rows = read_data(value, strict=main, keep_rows=keep_rows, progress=progress, **columns)
        if isinstance(rows, list) and hasattr(args, "model"):  # a file read whole: its ids now
            check_ids(args.model, rows)
    except GSSError as err:
        raise GSSError(f"{flag}: {err}") from None
    return rows


def check_ids(model: str, rows: list[Any]) -> None:
    """Rows given as token ids: each id inside ``model``'s vocabulary (its config.json) and,
    with labels, one label an id; said before any weights load (after, where no local config
    reads)."""
    from collections.abc import Mapping

    from gss.hf.forward import check_vocabulary
    from gss.signal.tokens import labels_mask

    given = []
    for i, row in enumerate(rows):
        ids = row.get("input_ids") if isinstance(row, Mapping) else row
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            continue
        if isinstance(row, Mapping) and row.get("labels") is not None:
            labels_mask(row["labels"], i, len(ids))
        given.append(ids)
    stand_in = config_stand_in(model) if given else None
    if stand_in is not None:
        check_vocabulary((stand_in,), given, "the rows' input_ids")


def check_delta(artifact: Any, delta: float | None) -> None:
    """A bad --delta fails before any model loads; a stack's strengths are not one number."""
    from gss.artifact.stack import SteeringStack

    if delta is None:
        return
    if isinstance(artifact, SteeringStack):
        raise GSSError(
            f"--delta sets one block's strength, and this is a steering stack of blocks "
            f"{list(artifact.layers)} whose strengths were chosen together: leave --delta out "
            "(or give one of its steer-<i> directories to steer that block alone)."
        )
    artifact.with_options(delta=delta)


def check_results(args: argparse.Namespace, names: list[str]) -> None:
    """`check_outputs` for the results a command writes into an optional ``--out``, and
    ``--overwrite`` without ``--out`` refused (it would replace nothing, silently)."""
    if args.overwrite and not args.out:
        raise GSSError(
            "--overwrite replaces results in --out: give --out DIR, or drop --overwrite."
        )
    check_outputs(args.out, names, args.overwrite)


def names_the_model(args: argparse.Namespace, value: str) -> bool:
    """Whether a model flag's ``value`` is --model: the same string or the same directory."""
    model, other = Path(args.model), Path(value)
    here = model.is_dir() and other.is_dir() and model.resolve() == other.resolve()
    return value == args.model or here


def check_reference(args: argparse.Namespace) -> None:
    """--reference naming --model (omega is 0 everywhere) fails after a whole pass in audit,
    protect, calibrate and layers: said before the models load (`gss signal` notes it)."""
    same_revision = getattr(args, "model_revision", None) == getattr(
        args, "reference_revision", None
    )
    if names_the_model(args, args.reference) and same_revision:
        raise GSSError(
            f"--reference {args.reference} is --model: a model's own log-probabilities mark no "
            "token memorized. Pass the model the fine-tune started from (for a LoRA: "
            "--reference adapters-off)."
        )
