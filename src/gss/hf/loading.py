"""Loading a fine-tuned model, its tokenizer and a reference model: by directory or Hub id.

Every entry point (the ``gss`` command, the benchmarks, a script) loads models the same way,
with ``from_pretrained``: from a local ``save_pretrained`` directory or PEFT adapter
directory, or from a Hugging Face Hub repo id (``org/name``, at a ``revision``) through the
user's Hub cache, offline when ``HF_HUB_OFFLINE`` is set (`gss.hf.hub`). Where it runs: one
``device``, or an ``accelerate`` ``device_map`` (``"auto"``, a device, or a dict of module
placements); how it is stored: a ``dtype``, and optionally quantized
(`gss.hf.quantization`). What can be checked before the weights load is: the path or repo,
the device, the backend, the reference's tokenizer. The dtype keyword of ``from_pretrained``
is ``torch_dtype`` before transformers 4.56 and ``dtype`` from then on (the old name warns
there).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from gss.errors import GSSError
from gss.hf.hub import (
    LOAD_ERRORS,
    ModelSource,
    cache_dir,
    download_command,
    hub_id,
    hub_options,
    load_error,
    load_failure,
    resolve,
)
from gss.hf.quantization import quantization_config

__all__ = [
    "ADAPTERS_OFF",
    "DEFAULT_MAX_LENGTH",
    "DEVICE_MAP_STRATEGIES",
    "DTYPES",
    "adapter_base",
    "check_device_map",
    "default_max_length",
    "dtype_keyword",
    "load_causal_lm",
    "load_model",
    "load_reference",
    "load_tokenizer",
    "load_weights",
    "local_dir",
    "model_source",
    "parse_device_map",
]

# `load_reference`'s name for the model's own base under its adapters (no second copy)
ADAPTERS_OFF = "adapters-off"
# tokens kept per text when no length is given (`default_max_length`)
DEFAULT_MAX_LENGTH = 512
# the dtypes weights load in, by name
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# the device maps accelerate computes from the memory it finds (else: a device, or a dict)
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
# a model or a reference: a directory, a Hub repo id, or one already resolved
Source = str | Path | ModelSource


def _transformers_major() -> int:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).major


def dtype_keyword() -> str:
    """``from_pretrained``'s dtype keyword in the installed transformers."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"


NO_CODE: dict[str, Any] = {"trust_remote_code": False}
"""Given to every ``from_pretrained``: a model folder's own Python (``auto_map``) is never run,
and transformers never asks on stdin whether to run it (a ``y`` there ran it): a model with a
built-in architecture loads as that, one without fails with one message (docs/security.md)."""


# the files a tokenizer saved with a model is read from (any one of them)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "merges.txt",
)


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The causal LM saved in the local directory ``path``, in ``dtype``; never downloads
    (the benchmarks' models, converted once).

    Any: transformers types ``to`` through a decorator that mypy reads as taking the model."""
    from transformers import AutoModelForCausalLM

    options: dict[str, Any] = {dtype_keyword(): dtype, "local_files_only": True, **NO_CODE}
    return AutoModelForCausalLM.from_pretrained(path, **options)


def local_dir(path: str | Path) -> Path:
    """``path`` as a `Path`, or a `GSSError` when it is no model directory."""
    p = Path(path)
    if not p.exists():
        raise GSSError(
            f"model path {path} does not exist: give the directory save_pretrained wrote, or a "
            "Hugging Face Hub repo id (org/name), which loads through the Hub cache."
        )
    if not p.is_dir() or not (
        (p / "config.json").is_file() or (p / "adapter_config.json").is_file()
    ):
        raise GSSError(
            f"{path} is not a model directory: it has no config.json (nor adapter_config.json). "
            "Give the folder that save_pretrained wrote."
        )
    return p


def model_source(path: Source, revision: str | None = None) -> ModelSource:
    """Where ``path`` loads from: a local model directory (`local_dir`), or a Hub repo id
    (``org/name`` naming no local path) at ``revision``, checked on the Hub or in its cache
    (`gss.hf.hub.resolve`) without loading any weights."""
    if isinstance(path, ModelSource):
        return path
    repo = hub_id(path)
    if repo is not None:
        return resolve(repo, revision)
    p = local_dir(path)
    if revision is not None:
        raise GSSError(
            f"revision {revision!r} names a revision of a Hub repo, and {path} is a local "
            "directory: leave the revision (--model-revision, --reference-revision) out, or "
            "give the repo id (org/name)."
        )
    base = adapter_base(p)
    # an adapter's base may be a Hub id: it loads through the cache, as a model named so
    options = {"local_files_only": True} if base is None or hub_id(base) is None else hub_options()
    return ModelSource(str(p), False, None, options, base)


def parse_device_map(text: str) -> str | dict[str, Any]:
    """``--device-map``: a strategy (``auto``, ...), a device (``cpu``, ``cuda:0``), or a JSON
    object of module placements (``{"model.layers.0": 0, "lm_head": "cpu", ...}``)."""
    if not text.strip().startswith("{"):
        return text.strip()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise GSSError(f"--device-map {text!r} is not a JSON object ({e.msg}).") from None
    return check_device_map(parsed)


def check_device_map(device_map: Any) -> str | dict[str, Any]:
    """``device_map`` for ``from_pretrained``, refused when accelerate, which places the
    modules, is missing, or when it names a device this machine lacks."""
    if importlib.util.find_spec("accelerate") is None:
        raise GSSError(
            "a device map places the model's modules with accelerate, which is not installed: "
            "pip install accelerate."
        )
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            check_device(device_map, "--device-map")
        return device_map
    if not isinstance(device_map, dict) or not device_map:
        raise GSSError(
            f"a device map is one of {', '.join(DEVICE_MAP_STRATEGIES)}, a device, or a "
            f"non-empty dict of module name to device; got {device_map!r}."
        )
    for name, where in device_map.items():
        if not isinstance(name, str):
            raise GSSError(f"device map keys are module names, got {name!r}.")
        if isinstance(where, bool) or not isinstance(where, (int, str)):
            raise GSSError(
                f"device map entry {name!r}: {where!r} is not a device (an index, cpu, disk, "
                "cuda:N)."
            )
        if where != "disk":
            device = f"cuda:{where}" if isinstance(where, int) else where
            check_device(device, f"--device-map's {name!r} on")
    return device_map


def check_device(device: str | torch.device, where: str = "--device") -> torch.device:
    """``device`` as a `torch.device`, refused when this torch cannot run on it; ``where``
    names what gave it (the flag, or a device map's entry)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise GSSError(
            f"{where} {device!r} is not a torch device ({err}); e.g. cpu or cuda:0."
        ) from None
    cpu = "--device cpu" if where == "--device" else "cpu"
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GSSError(
            f"{where} {device}: this torch ({torch.__version__}) sees no CUDA GPU; use {cpu}, or "
            "install a CUDA build of torch on a machine with a GPU."
        )
    backend = getattr(torch, dev.type, None)  # torch.mps, torch.xpu, ...
    available = getattr(backend, "is_available", None)
    if dev.type not in ("cpu", "cuda", "meta") and not (callable(available) and available()):
        raise GSSError(
            f"{where} {device}: this torch ({torch.__version__}) cannot run on {dev.type} here; "
            f"use {cpu}, or cuda on a machine with a GPU."
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise GSSError(
            f"{where} {device}: there are {torch.cuda.device_count()} CUDA devices here."
        )
    return dev


def adapter_base(path: str | Path) -> str | None:
    """The base model path a PEFT adapter directory names, or None when ``path`` is not one."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    return str(base) if base else None


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise GSSError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}.")
    return DTYPES[dtype]


_OFFLOAD: list[str] = []  # the folders disk-offloaded weights went to, removed at exit


def _offload_folder() -> str:
    """A folder for the weights a device map sends to "disk" (made once, removed at exit)."""
    if not _OFFLOAD:
        _OFFLOAD.append(tempfile.mkdtemp(prefix="gss-offload-"))
        atexit.register(shutil.rmtree, _OFFLOAD[0], True)
    return _OFFLOAD[0]


def _placement(
    device: str | torch.device | None,
    dtype: str | torch.dtype,
    device_map: str | dict[str, Any] | None,
    quantization: Any,
) -> tuple[dict[str, Any], torch.device | None]:
    """``from_pretrained``'s keywords for where and how the weights load, and the device to
    move the model to afterwards (None: placed while loading), all checked before anything
    loads."""
    torch_dtype = _torch_dtype(dtype)
    if device is not None and device_map is not None:
        raise GSSError(
            f"--device {device} and --device-map both say where the model runs: give one "
            "(--device-map cuda:0 is --device cuda:0 through accelerate)."
        )
    dev = check_device("cpu" if device is None else device) if device_map is None else None
    placement = None if device_map is None else check_device_map(device_map)
    options: dict[str, Any] = {dtype_keyword(): torch_dtype}
    qconfig = quantization_config(quantization, torch_dtype, dev)
    if qconfig is not None:
        options["quantization_config"] = qconfig
        if dev is not None:  # quantized weights are made where they run: no move after
            if dev.type == "cuda":
                placement = {"": torch.cuda.current_device() if dev.index is None else dev.index}
            else:
                placement = {"": str(dev)}
    if placement is None:
        return options, dev
    options["device_map"] = placement
    spread = placement in DEVICE_MAP_STRATEGIES
    if spread or (isinstance(placement, dict) and "disk" in placement.values()):
        options["offload_folder"] = _offload_folder()
    return options, None


def _check_peft(source: ModelSource) -> ModelSource:
    """``source``, refused when it is a PEFT adapter and peft, which loads one, is missing."""
    if source.adapter_base is not None and importlib.util.find_spec("peft") is None:
        raise GSSError(
            f"{source.describe()} is a PEFT adapter; loading it needs peft: pip install "
            "'gated-subspace-steering[peft]'."
        )
    return source


def load_weights(
    path: Source,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "float32",
    *,
    device_map: str | dict[str, Any] | None = None,
    quantization: Any = None,
    revision: str | None = None,
) -> Any:
    """The causal LM at ``path`` (a local directory or a Hub repo id at ``revision``: a PEFT
    adapter loads its base with the adapters, which needs peft), in ``dtype`` (a `DTYPES`
    name or a torch dtype), on ``device`` (default cpu) or placed by ``device_map``
    (accelerate: a strategy such as ``"auto"``, a device, or a dict; not both), quantized when
    ``quantization`` names a backend (`gss.hf.quantization.QUANTIZATIONS`) or is a
    transformers quantization config."""
    from transformers import AutoModelForCausalLM

    options, move_to = _placement(device, dtype, device_map, quantization)
    source = _check_peft(model_source(path, revision))
    options.update(source.options)
    if source.adapter_base is not None or (source.repo and _transformers_major() >= 5):
        # transformers' own adapter check takes the cache and offline mode from here alone (in
        # 4.x only for an adapter: for a model, 4.x passes them itself and refuses them twice)
        options["adapter_kwargs"] = dict(source.options)
    options.update(NO_CODE)
    # which of the model's tensors the files lacked (not where an adapter or a quantizer
    # changes the model's tensors: what it lacks is theirs to say)
    report = source.adapter_base is None and quantization is None
    if report:
        options["output_loading_info"] = True
    loaded: Any = load_error(
        source, "the model", lambda: AutoModelForCausalLM.from_pretrained(source.name, **options)
    )
    model, info = loaded if report else (loaded, {})
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise GSSError(
            f"the weights at {source.describe()} lack {len(missing)} of the model's tensors "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): transformers "
            "would start them from random values, and every result would be of another "
            "model. The files are incomplete (a download or save cut short) or do not match "
            "config.json (its layers or architecture): fetch or save them again."
        )
    if move_to is not None:
        model.to(move_to)
    return model


def load_tokenizer(path: Source, revision: str | None = None) -> Any:
    """The tokenizer at ``path`` (a local directory or a Hub repo id at ``revision``); for a
    PEFT adapter without tokenizer files, its base model's."""
    from transformers import AutoTokenizer

    source = model_source(path, revision)
    base = source.adapter_base
    folder = Path(source.name)
    here = not source.repo and base is None and folder.is_dir()
    if here and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise GSSError(
            f"{source.name} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, "
            "...): save the model's tokenizer beside it (tokenizer.save_pretrained(path)), "
            "or give the directory that has it."
        )
    if here and (folder / "tokenizer.json").is_file():
        # transformers 4.x meets a broken tokenizer.json by falling back to a slow tokenizer
        # and asking for protobuf or sentencepiece: say what is wrong before it does
        try:
            json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise load_failure(source, "the tokenizer", e) from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.name, **source.options, **NO_CODE)
    except LOAD_ERRORS as e:  # a tokenizer_config.json or config.json holding no JSON object
        if base is None:
            raise load_failure(source, "the tokenizer", e) from e
    else:
        if len(tokenizer) > 1:
            return tokenizer
        if base is None and source.repo:  # transformers 5 builds an empty one from no files
            fetch = download_command(source.name, source.revision)
            raise GSSError(
                f"{source.describe()} has no tokenizer files here (in the Hub cache, "
                f"{cache_dir()}): run `{fetch}` to fetch the whole repo, or give the model's "
                "directory."
            )
        if base is None:
            raise GSSError(
                f"{source.name} holds no tokenizer (the one transformers built from it has "
                f"{len(tokenizer)} token): save the model's tokenizer beside it "
                "(tokenizer.save_pretrained(path)), or give the directory that has it."
            )
    repo = hub_id(base) is not None
    options = hub_options() if repo else {"local_files_only": True}
    return load_error(
        ModelSource(base, repo, None, options),
        "the tokenizer of the adapter's base model",
        lambda: AutoTokenizer.from_pretrained(base, **options, **NO_CODE),
    )


def load_model(
    path: Source,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "float32",
    *,
    device_map: str | dict[str, Any] | None = None,
    quantization: Any = None,
    revision: str | None = None,
) -> tuple[Any, Any]:
    """The fine-tuned model at ``path`` (see `load_weights`) and its tokenizer
    (`load_tokenizer`), the tokenizer first: it fails in seconds where weights take
    minutes."""
    _placement(device, dtype, device_map, quantization)  # a bad option fails before any load
    source = _check_peft(model_source(path, revision))
    tokenizer = load_tokenizer(source)
    weights = load_weights(source, device, dtype, device_map=device_map, quantization=quantization)
    return weights, tokenizer


def load_reference(
    path: Source,
    model: Any,
    tokenizer: Any,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "float32",
    *,
    device_map: str | dict[str, Any] | None = None,
    quantization: Any = None,
    revision: str | None = None,
) -> Any:
    """The reference model ``model`` is compared with: loaded from ``path`` (a local directory
    or a Hub repo id, as `load_weights`; its tokenizer must be ``tokenizer``:
    `gss.data.check_same_tokenizer`), or, for ``path`` `ADAPTERS_OFF`, ``model``'s own base
    with its adapters switched off (no second copy: `gss.hf.adapters.adapters_off`)."""
    if isinstance(path, str) and path == ADAPTERS_OFF:
        from gss.hf.adapters import adapters_off

        return adapters_off(model)
    from gss.data import check_same_tokenizer

    _placement(device, dtype, device_map, quantization)  # a bad option fails before any load
    source = model_source(path, revision)
    # before the weights load: a wrong reference fails in seconds
    check_same_tokenizer(tokenizer, load_tokenizer(source))
    return load_weights(source, device, dtype, device_map=device_map, quantization=quantization)


def default_max_length(model: torch.nn.Module) -> int:
    """Tokens kept per text when none is asked for: `DEFAULT_MAX_LENGTH`, or the model's
    context if shorter, so that the default never asks a model for positions it lacks."""
    from gss.hf.forward import context_length

    found = context_length(model)
    return min(DEFAULT_MAX_LENGTH, found[0]) if found else DEFAULT_MAX_LENGTH
