"""``torch.compile`` and gss's wrapped forwards: find where a steer would silently not run.

gss attaches nothing as a forward hook: a steer, and calibration's read of a block, wrap the
block's ``forward`` (``gss.steering.attach.SteeredForward``, an instance attribute). With
modules inlined (always from torch 2.5), dynamo guards on that attribute, so code compiled
before the steer was attached recompiles when it is, and again when it comes off
(``tests/steering/test_compiled.py``, every way of compiling). A forward hook would not do: with
``skip_nnmodule_hook_guards`` on (torch's default), code compiled while a module had no hooks
never looks for them again. Before torch 2.5 modules are not inlined by default, and then
compiled code did not see late hooks even with their guards on (measured on torch 2.4.1); a
wrapped forward was not measured there, so gss refuses a compiled model until
``inline_inbuilt_nn_modules`` is set.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

from gss.errors import GSSError

_INLINING = "torch._dynamo.config.inline_inbuilt_nn_modules = True"


def _modules_inlined() -> bool:
    """Whether dynamo inlines ``nn.Module`` calls (and so guards on an instance ``forward``):
    always from torch 2.5, where the flag is deprecated and says so when read; before, only when
    set."""
    dynamo = sys.modules.get("torch._dynamo")  # never imported: nothing was compiled
    if dynamo is None:
        return True
    with warnings.catch_warnings(record=True) as read:
        warnings.simplefilter("always")
        inlines = bool(getattr(dynamo.config, "inline_inbuilt_nn_modules", True))
    return inlines or any(issubclass(w.category, FutureWarning) for w in read)


def compiled_parts(model: nn.Module) -> list[str]:
    """Where ``model`` holds ``torch.compile`` code: a wrapper from ``torch.compile(model)``,
    ``module.compile()``, a compiled ``forward`` set on a module, or the compiled call that
    ``generate`` makes for a static cache. Empty when torch's compiler was never imported."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return []
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", ())
    found = []
    for name, module in model.named_modules():
        where = f"module {name!r}" if name else "the model"
        own = vars(module)
        if isinstance(module, optimized):
            found.append(f"{where}: a torch.compile wrapper")
        elif own.get("_compiled_call_impl") is not None:
            found.append(f"{where}: .compile()")
        elif hasattr(own.get("forward"), "_torchdynamo_orig_callable"):
            found.append(f"{where}: a compiled forward")
        elif own.get("_compiled_call") is not None:
            found.append(f"{where}: compiled by generate for a static cache")
    return found


def refuse_if_compiled(model: nn.Module, *, reading: bool = False) -> None:
    """Raise before wrapping a block's forward where compiled code in ``model`` would not see
    it: the steer, or (``reading``) calibration's read of a block's output."""
    parts = [] if _modules_inlined() else compiled_parts(model)
    if not parts:
        return
    if reading:
        what = "calibration's read of a block's output would not run"
        fix = (
            "Calibrate before compiling (for torch.compile(model), pass the model it wraps: "
            f"._orig_mod), or set {_INLINING} before compiling."
        )
    else:
        what = "the steer would silently not run"
        fix = f"Attach the steer before compiling, or set {_INLINING} before compiling."
    raise GSSError(
        f"the model holds torch.compile code ({'; '.join(parts)}), and this torch does not "
        f"inline modules when compiling, so compiled code may not see a block changed after "
        f"compiling: {what}. {fix}"
    )
