"""Loading a local ``save_pretrained`` model the same way on every transformers the package
supports (``>= 4.46``): the dtype keyword of ``from_pretrained`` is ``torch_dtype`` before 4.56
and ``dtype`` from then on (the old name warns there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


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
