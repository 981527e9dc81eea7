"""``torch.compile`` and forward hooks: find the case where a steer would silently not run.

With ``torch._dynamo.config.skip_nnmodule_hook_guards`` on (torch's default), code compiled
while a module had no forward hooks does not check for them again: a hook attached later never
runs in it (before torch 2.5, also unless ``inline_inbuilt_nn_modules`` is on). A hook present
when compiling is guarded: removing it recompiles. A steer attached to a model compiled
without it would leave every output unsteered without a word, so attaching refuses such a
model, as does calibration, which reads a block with a hook.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

from .errors import GSSError

_HOOK_GUARDS = "torch._dynamo.config.skip_nnmodule_hook_guards = False"
_INLINING = "torch._dynamo.config.inline_inbuilt_nn_modules = True"


def _settings_that_hide_late_hooks() -> list[str]:
    """The dynamo settings to change so that compiled code sees hooks added after compiling.

    Hook guards are skipped by default; before torch 2.5, modules are also not inlined by
    default, and then even guarded hooks added later are not seen (measured on torch 2.4)."""
    dynamo = sys.modules.get("torch._dynamo")  # never imported: nothing was compiled
    if dynamo is None:
        return []
    config = dynamo.config
    with warnings.catch_warnings(record=True) as read:
        warnings.simplefilter("always")
        inlines = bool(getattr(config, "inline_inbuilt_nn_modules", True))
    # newer torch always inlines: the flag is deprecated there, does nothing and says so
    inlines = inlines or any(issubclass(w.category, FutureWarning) for w in read)
    changes = [_HOOK_GUARDS] if getattr(config, "skip_nnmodule_hook_guards", True) else []
    return changes + ([] if inlines else [_INLINING])


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
    """Raise before attaching a hook that compiled code in ``model`` would never run: the
    steer, or (``reading``) calibration's read of a block's output."""
    settings = _settings_that_hide_late_hooks()
    parts = compiled_parts(model) if settings else []
    if not parts:
        return
    to_set = " and ".join(settings)
    if reading:
        what = "calibration reads a block's output with a forward hook, which it would not run"
        fix = (
            "Calibrate before compiling (for torch.compile(model), pass the model it wraps: "
            f"._orig_mod), or set {to_set} before compiling."
        )
    else:
        what = "the steer would silently not run"
        fix = (
            f"Set {to_set} before compiling (torch then compiles the steered and the "
            "unsteered model once each and picks the right one), or attach the steer before "
            "compiling."
        )
    raise GSSError(
        f"the model holds torch.compile code ({'; '.join(parts)}), and with these dynamo "
        f"settings compiled code does not see forward hooks added after compiling: {what}. "
        f"{fix}"
    )
