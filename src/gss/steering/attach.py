"""How a steer is put on a decoder block: inside the block's ``forward``, not as a forward hook.

A hook here is anything called as ``hook(block, args, output)`` that returns the new output (or
None to keep it): a :class:`gss.steering.gated.GatedSteer`, a baseline's steer, or
calibration's read of a block. `register` installs it with a :class:`SteeredForward` and
returns a :class:`SteerHandle`; `split_block_output` reads the hidden states out of whatever
the block returned.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from gss.errors import GSSError, GSSWarning
from gss.hf import adapters
from gss.steering.compiled import refuse_if_compiled


def split_block_output(output: Any) -> tuple[Tensor, Callable[[Tensor], Any]]:
    """Return the hidden states a block produced and a function that rebuilds the output.

    transformers 5 blocks return a plain tensor, older ones a tuple (or list) whose first item
    is the hidden states.
    """
    if isinstance(output, Tensor):
        return output, lambda h: h
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        rest = output[1:]
        return output[0], lambda h: (h, *rest)
    if isinstance(output, list) and output and isinstance(output[0], Tensor):
        rest_list = output[1:]
        return output[0], lambda h: [h, *rest_list]
    raise GSSError(
        f"cannot read hidden states from a block output of type {type(output).__name__}; "
        "gss supports blocks returning a tensor or a tuple whose first item is the hidden states."
    )


def _unchanged(module: nn.Module, args: Any, output: Any) -> None:
    return None


class SteeredForward:
    """A block's ``forward`` with a hook applied to its output, installed as the block's
    instance attribute: how every steer is attached (`register`), rather than with
    ``register_forward_hook``, for two reasons. Dynamo guards on the instance attribute, so
    code compiled before the steer was attached recompiles with it, and without it once it is
    removed, where it would never look for a forward hook added after compiling
    (``compiled.py``). And a forward hook sends every call of the block through
    ``nn.Module``'s slow dispatch path (0.1-0.3% of the tiny model's CPU decode step in
    ``gss bench perf``); here the call stays on the fast path. Removable like a hook's handle.

    Every forward hook on the block sees the steered output. An instance ``forward`` already
    there (accelerate's dispatch) is wrapped and restored. If another wrapper was put on top
    of this one, removing it only turns it into a pass-through, so that wrapper keeps working.
    A deep copy of the model copies the wrapper bound to the copied block.

    Removed from the top, the wrapper lets go of the block and its hook and can be installed
    again (`install`), which `register` does with the block's last one: compiled code guards
    on the wrapper's identity, so the same wrapper finds the code compiled with it, where a
    new one would compile the model again on every attach.
    """

    def __init__(
        self, block: nn.Module, hook: Callable[..., Any] = _unchanged, steer: bool = False
    ) -> None:
        self.steer = steer  # a steer's (`register`), not a calibration tap's: `steers_paused`
        self.install(block, hook)

    def install(self, block: nn.Module, hook: Callable[..., Any]) -> None:
        """Put this wrapper on ``block`` with ``hook`` (it must not be installed anywhere)."""
        self.block: nn.Module | None = block
        self.hook = hook
        self.forward: Callable[..., Any] | None = block.forward  # instance attribute or method
        self._had_instance_forward = "forward" in block.__dict__
        block.forward = self

    @property
    def installed(self) -> bool:
        return self.block is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.forward(*args, **kwargs)  # type: ignore[misc]  # None only once removed
        steered = self.hook(self.block, args, output)
        return output if steered is None else steered

    def remove(self) -> None:
        block = self.block
        if block is None:
            return
        self.hook = _unchanged
        if block.__dict__.get("forward") is not self:
            return  # wrapped again since: stay in the chain, steer nothing, until it is on top
        self._unlink(block)
        # pass-throughs left below (steers removed while this one was on top) come off too:
        # else each attach and out-of-order remove would leave one more for good
        below = block.__dict__.get("forward")
        while isinstance(below, SteeredForward) and below.hook is _unchanged:
            below._unlink(block)
            below = block.__dict__.get("forward")

    def _unlink(self, block: nn.Module) -> None:
        if self._had_instance_forward:
            assert self.forward is not None  # installed: it holds what it wrapped
            block.forward = self.forward
        else:
            del block.forward
        self.block = self.forward = None  # nothing kept alive by a wrapper off its block


_LAST_WRAPPER = "_gss_steered_forward"  # the block's attribute that keeps its last wrapper


class SteerHandle:
    """A removable steer; also a context manager that removes itself on exit."""

    def __init__(self, hook: Any, handle: SteeredForward) -> None:
        self.hook = hook
        self._handle: SteeredForward | None = handle
        self._also: list[Any] = []  # more to remove with it (hooks that feed the steer)

    def remove_with(self, removable: Any) -> None:
        """Remove ``removable`` (anything with ``remove()``) when this steer is removed."""
        self._also.append(removable)

    @property
    def active(self) -> bool:
        return self._handle is not None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        while self._also:
            self._also.pop().remove()

    def gate_stats(self) -> dict[str, Any]:
        """Gate counters of a :class:`GatedSteer` with ``track_gates`` ({} for other hooks)."""
        stats = getattr(self.hook, "gate_stats", None)
        return stats() if callable(stats) else {}

    def reset_stats(self) -> None:
        reset = getattr(self.hook, "reset_stats", None)
        if callable(reset):
            reset()

    def __enter__(self) -> SteerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register(
    block: nn.Module, hook: Callable[..., Any], model: nn.Module | None = None
) -> SteerHandle:
    """Apply ``hook(block, args, output)`` to every output of ``block``, inside its ``forward``
    (:class:`SteeredForward`), so every forward hook on the block, and
    ``output_hidden_states``, sees the steered output; ``model`` is the model ``block`` is in,
    searched for compiled code that would not run the steer (the block alone when None)."""
    refuse_if_compiled(block if model is None else model)
    last = block.__dict__.get(_LAST_WRAPPER)
    if isinstance(last, SteeredForward) and not last.installed:
        last.install(block, hook)  # the one compiled code knows
        return SteerHandle(hook, last)
    wrapper = SteeredForward(block, hook, steer=True)
    # kept unless the last one still steers (it comes back when that one is removed)
    if not isinstance(last, SteeredForward) or last.hook is _unchanged:
        block.__dict__[_LAST_WRAPPER] = wrapper  # not nn.Module's setattr: no submodule
    return SteerHandle(hook, wrapper)


def _same(a: object, b: object) -> bool:
    """Two steers' origins name the same steer: equal identities (tuples: an artifact's
    `identity`), else the same object."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return a == b
    return a is b


def warn_if_steering(block: nn.Module, origin: object, doing: str) -> None:
    """Warn when the steer whose hooks carry ``origin`` already steers ``block``: ``doing``
    it again would apply the steer twice."""
    if any(_same(getattr(hook, "origin", None), origin) for hook in active_hooks(block)):
        warnings.warn(
            "this artifact already steers this block (a gss.steer or attach not yet removed): "
            f"{doing} applies the steer twice.",
            GSSWarning,
            stacklevel=3,
        )


def warn_if_steered(block: nn.Module, doing: str) -> None:
    """Warn when some steer is attached at ``block``: ``doing`` would read the hidden states it
    steered, not the model's own."""
    if active_hooks(block):
        warnings.warn(
            f"a steer is attached at this block (a gss.steer or attach not yet removed): {doing} "
            "reads the steered hidden states. Remove it first for the model's own.",
            GSSWarning,
            stacklevel=3,
        )


@contextmanager
def steers_paused(model: nn.Module) -> Iterator[None]:
    """Every steer on ``model``'s blocks passes its output through unchanged inside (the
    taps that read blocks for calibration keep reading): for a reference that shares the
    model's blocks (`gss.adapters_off`), which must be the base model, not the steered one."""
    paused = []
    for module in model.modules():
        forward = module.__dict__.get("forward")
        while isinstance(forward, SteeredForward):
            if forward.steer and forward.hook is not _unchanged:
                paused.append((forward, forward.hook))
                forward.hook = _unchanged
            forward = forward.forward
    try:
        yield
    finally:
        for forward, hook in paused:
            forward.hook = hook


adapters.PAUSES.append(steers_paused)  # the base model under `gss.adapters_off` runs unsteered


def active_hooks(block: nn.Module) -> list[Any]:
    """The hooks of the wrappers now steering ``block``, outermost first."""
    hooks = []
    forward = block.__dict__.get("forward")
    while isinstance(forward, SteeredForward):
        if forward.hook is not _unchanged:
            hooks.append(forward.hook)
        forward = forward.forward
    return hooks
