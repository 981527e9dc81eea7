"""Loading a fine-tuned model, its tokenizer and a reference model from local directories.

Every entry point (the ``gss`` command, the benchmarks, a script) loads models the same way:
from a local ``save_pretrained`` directory or a PEFT adapter directory, never from the network,
on every transformers the package supports (``>= 4.46``): the dtype keyword of
``from_pretrained`` is ``torch_dtype`` before 4.56 and ``dtype`` from then on (the old name
warns there).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from gss.errors import GSSError

__all__ = [
    "ADAPTERS_OFF",
    "DEFAULT_MAX_LENGTH",
    "DTYPES",
    "adapter_base",
    "default_max_length",
    "dtype_keyword",
    "load_causal_lm",
    "load_model",
    "load_reference",
    "load_tokenizer",
    "load_weights",
    "local_dir",
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


def dtype_keyword() -> str:
    """``from_pretrained``'s dtype keyword in the installed transformers."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The causal LM saved in the local directory ``path``, in ``dtype``; never downloads.

    Any: transformers types ``to`` through a decorator that mypy reads as taking the model."""
    from transformers import AutoModelForCausalLM

    options: dict[str, Any] = {dtype_keyword(): dtype, "local_files_only": True}
    return AutoModelForCausalLM.from_pretrained(path, **options)


def local_dir(path: str | Path) -> Path:
    """``path`` as a `Path`, or a `GSSError` when it does not exist: gss never downloads."""
    p = Path(path)
    if not p.exists():
        raise GSSError(
            f"model path {path} does not exist. gss loads models from a local directory "
            "(save_pretrained output); it never downloads."
        )
    if not p.is_dir() or not (
        (p / "config.json").is_file() or (p / "adapter_config.json").is_file()
    ):
        raise GSSError(
            f"{path} is not a model directory: it has no config.json (nor adapter_config.json). "
            "Give the folder that save_pretrained wrote."
        )
    return p


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a `torch.device`, refused when this torch cannot run on it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise GSSError(f"{device!r} is not a torch device ({err}); e.g. cpu or cuda:0.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GSSError(
            f"--device {device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device "
            "cpu, or install a CUDA build of torch on a machine with a GPU."
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise GSSError(
            f"--device {device}: there are {torch.cuda.device_count()} CUDA devices here."
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


def load_weights(
    path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"
) -> Any:
    """The causal LM in the local directory ``path`` (a PEFT adapter directory loads its base
    with the adapters, which needs peft), in ``dtype`` (a `DTYPES` name or a torch dtype), moved
    to ``device``."""
    p = local_dir(path)
    check_device(device)
    torch_dtype = _torch_dtype(dtype)
    if adapter_base(p) is not None and importlib.util.find_spec("peft") is None:
        raise GSSError(
            f"{p} is a PEFT adapter directory; loading it needs peft: pip install "
            "'gated-subspace-steering[peft]'."
        )
    model = load_causal_lm(p, torch_dtype)
    model.to(device)
    return model


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in the local directory ``path``; for an adapter directory without
    tokenizer files, its base model's."""
    from transformers import AutoTokenizer

    p = local_dir(path)
    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError):
        base = adapter_base(p)
        if base is None:
            raise
        return AutoTokenizer.from_pretrained(base, local_files_only=True)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"
) -> tuple[Any, Any]:
    """The fine-tuned model in the local directory ``path`` (see `load_weights`) and its
    tokenizer (`load_tokenizer`)."""
    p = local_dir(path)
    return load_weights(p, device, dtype), load_tokenizer(p)


def load_reference(
    path: str | Path,
    model: Any,
    tokenizer: Any,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
) -> Any:
    """The reference model ``model`` is compared with: loaded from the local directory
    ``path`` (its tokenizer must be ``tokenizer``: `gss.data.check_same_tokenizer`), or, for
    ``path`` `ADAPTERS_OFF`, ``model``'s own base with its adapters switched off (no second
    copy: `gss.hf.adapters.adapters_off`)."""
    if isinstance(path, str) and path == ADAPTERS_OFF:
        from gss.hf.adapters import adapters_off

        return adapters_off(model)
    from gss.data import check_same_tokenizer

    p = local_dir(path)
    # before the weights load: a wrong reference fails in seconds
    check_same_tokenizer(tokenizer, load_tokenizer(p))
    return load_weights(p, device, dtype)


def default_max_length(model: torch.nn.Module) -> int:
    """Tokens kept per text when none is asked for: `DEFAULT_MAX_LENGTH`, or the model's
    context if shorter, so that the default never asks a model for positions it lacks."""
    from gss.hf.forward import context_length

    found = context_length(model)
    return min(DEFAULT_MAX_LENGTH, found[0]) if found else DEFAULT_MAX_LENGTH
