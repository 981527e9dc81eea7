"""The gated subspace steer on the output of one decoder block.

Per token, the hook computes all K probe responses ``s = U h - b`` with one matmul, opens the
gate of direction k where the response passes its threshold, and subtracts
``sum_k c_k v_k`` from the block output. Everything is computed in float32 and cast back to the
activation dtype; a token whose gates all stay closed gets a correction of exactly zero, so its
output is bit-for-bit unchanged. The hook does no host synchronisation and no Python branching
on tensor values, so it runs the same under ``generate``, the KV cache, CUDA graphs and
``torch.compile`` (attached before compiling or after: see ``compiled.py``).
It knows nothing about artifacts or files: it takes tensors and options.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gss.errors import GSSError
from gss.steering.compiled import refuse_if_compiled

GateMode = Literal["hard", "relu", "none"]
CoefficientMode = Literal["projection", "ridge", "paper-constant"]
GATE_MODES: tuple[str, ...] = ("hard", "relu", "none")
COEFFICIENT_MODES: tuple[str, ...] = ("projection", "ridge", "paper-constant")


def split_block_output(output: Any) -> tuple[Tensor, Callable[[Tensor], Any]]:
    """Return the hidden states a block produced and a function that rebuilds the output.

    transformers 5 blocks return a plain tensor, older ones a tuple whose first item is the
    hidden states; some return a ModelOutput-like object with ``hidden_states``.
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


class _NotBuiltFor(RuntimeError):
    """A tensor the hook's fast path was not built for: the checked path takes it."""


def _ungated(s: Tensor, _lambd: float) -> Tensor:
    return s


class GatedSteer:
    """Gated rank-K steer: ``h <- h - sum_k c_k(s_k) v_k`` where the gate of k is open.

    Args:
        probe: (K, d) probe directions u_k.
        steer: (K, d) steer directions v_k (unit norm).
        thresholds: (K,) gate thresholds eps_k on the probe response.
        offset: (K,) subtracted from ``U h`` (``U mu`` for centred probes), default zeros.
        gate: ``"hard"`` (|s_k| > eps_k, the paper's main text), ``"relu"`` (one-sided
            s_k > eps_k with correction ReLU(s_k - eps_k), the appendix) or ``"none"``
            (ungated: always open).
        coefficient: ``"projection"`` (c_k = s_k, Algorithm 1), ``"ridge"`` (the appendix's
            ridge minimiser with the (s_k - eps_k) factor kept) or ``"paper-constant"``
            (c_k = <u,v>/(<u,v>^2 + delta), as printed in the main text).
        delta: the variance budget, used by ``paper-constant``.
        ridge_delta: the ridge regulariser of ``ridge`` (defaults to ``delta``).
        min_alignment: ``ridge`` skips directions whose |<u_k, v_k>| / ||u_k|| is below this,
            where the coefficient would blow up.
        track_gates: count how often each direction's gate opens (on device, no sync).
        cpu_kernel: steer with a compiled C++ hook (`forward_hook`) that steers CPU decode
            steps (float32, bfloat16, float16) in one C call instead of three PyTorch ops (five
            with a 16-bit model's casts) and hands everything else
            to this object (``cpu_kernel.py``; built on first use, needs a C++ compiler and
            ninja). For the projection coefficient with the hard gate or none.
        cuda_kernel: run CUDA decode steps (any float dtype) through one Triton kernel
            instead of five PyTorch kernels in eager code; code torch.compile traces gets the
            PyTorch ops, which it fuses itself (``cuda_kernel.py``; needs a GPU and Triton).
            For the same steers as ``cpu_kernel``.
    """

    def __init__(
        self,
        probe: Tensor,
        steer: Tensor,
        thresholds: Tensor,
        offset: Tensor | None = None,
        *,
        gate: GateMode = "hard",
        coefficient: CoefficientMode = "projection",
        delta: float = 1.0,
        ridge_delta: float | None = None,
        min_alignment: float = 1e-3,
        track_gates: bool = False,
        cpu_kernel: bool = False,
        cuda_kernel: bool = False,
    ) -> None:
        if gate not in GATE_MODES:
            raise GSSError(f"gate must be one of {GATE_MODES}, got {gate!r}.")
        if coefficient not in COEFFICIENT_MODES:
            raise GSSError(f"coefficient must be one of {COEFFICIENT_MODES}, got {coefficient!r}.")
        if probe.ndim != 2 or steer.shape != probe.shape:
            raise GSSError(
                f"probe and steer must both be (K, d); got {tuple(probe.shape)} and "
                f"{tuple(steer.shape)}."
            )
        k = probe.shape[0]
        if thresholds.shape != (k,):
            raise GSSError(f"thresholds must have shape ({k},), got {tuple(thresholds.shape)}.")
        self.gate = gate
        self.coefficient = coefficient
        self.hidden_size = probe.shape[1]
        probe32 = probe.detach().float()
        steer32 = steer.detach().float()
        offset32 = torch.zeros(k) if offset is None else offset.detach().float().reshape(k)
        alignment = (probe32 * steer32).sum(-1)
        if coefficient == "paper-constant":
            scale = alignment / (alignment**2 + delta)
        elif coefficient == "ridge":
            rd = delta if ridge_delta is None else ridge_delta
            scale = alignment / (alignment**2 + rd)
            usable = alignment.abs() >= min_alignment * probe32.norm(dim=-1).clamp_min(1e-30)
            scale = torch.where(usable, scale, torch.zeros_like(scale))
        else:
            scale = torch.ones(k)
        self._cpu = {
            "probe_t": probe32.t().contiguous(),
            "steer": steer32.contiguous(),
            "thresholds": thresholds.detach().float().clone(),
            "offset": offset32.clone(),
            "neg_offset": -offset32,
            "scale": scale.float(),
        }
        self._on: dict[torch.device, dict[str, Tensor]] = {}
        # The paper's case with every threshold positive runs fused: the probe rows and offsets
        # are divided by eps_k and the (negated) steer rows multiplied by it, so the hard gate
        # is one hardshrink at 1 (exactly 0 where closed) between two multiply-adds.
        self._fused = False
        eps32 = self._cpu["thresholds"]
        if coefficient == "projection" and (gate == "none" or bool((eps32 > 0).all())):
            unit = eps32 if gate == "hard" else torch.ones(k)
            fused = {
                "fused_probe_t": (probe32 / unit[:, None]).t().contiguous(),
                "fused_neg_offset": -offset32 / unit,
                "fused_neg_steer": (-steer32 * unit[:, None]).contiguous(),
            }
            # an infinite threshold (a gate that never opens) or an extreme one stays unfused
            if all(bool(torch.isfinite(t).all()) for t in fused.values()):
                self._cpu.update(fused)
                self._fused = True
        self._cpu_kernel: Callable[..., Callable[..., Any]] | None = None
        self._cuda_kernel: Callable[..., Callable[[Tensor], Tensor]] | None = None
        if cpu_kernel or cuda_kernel:
            if not self._fused:
                option = "cpu_kernel" if cpu_kernel else "cuda_kernel"
                raise GSSError(
                    f"{option}=True runs the fused steer: the projection coefficient with the "
                    f"hard gate (every threshold positive and finite) or none; this steer has "
                    f"gate={gate!r}, coefficient={coefficient!r}. Attach without {option}."
                )
            if cpu_kernel:
                from gss.steering import cpu_kernel as compiled_kernel

                self._cpu_kernel = compiled_kernel.load()
            if cuda_kernel:
                from gss.steering import cuda_kernel as triton_kernel

                self._cuda_kernel = triton_kernel.load()
        # the fused steer bound to one device's tensors, built on the first float32 call: what
        # every decode step runs (see __call__)
        self._fast: Callable[[Tensor], Tensor] | None = None
        self._fast_failed = False
        self._track_gates = track_gates
        # read by the compiled hooks on every call: off while gates are tracked, which only
        # the Python path does
        self._compiled_on = torch.tensor(not track_gates)
        self.open_counts: Tensor | None = None
        self.token_count = 0
        self.any_open_count: Tensor | None = None

    @property
    def track_gates(self) -> bool:
        """Count gate openings (the fused fast path does not, so it is off while this is on)."""
        return self._track_gates

    @track_gates.setter
    def track_gates(self, value: bool) -> None:
        self._track_gates = value
        self._compiled_on.fill_(not value)
        self._fast = None

    def forward_hook(self) -> Callable[..., Any]:
        """The callable to register on the block. With ``cpu_kernel``, a new compiled hook: one
        C function that steers a CPU decode step (float32 or 16-bit) without entering Python
        and calls this object for anything else (a prompt pass, another dtype, a gradient,
        gate tracking); else this object itself."""
        if self._cpu_kernel is None:
            return self
        f = self._cpu
        return self._cpu_kernel(
            f["fused_probe_t"].t().contiguous(),
            f["fused_neg_offset"],
            f["fused_neg_steer"],
            self._compiled_on,
            self.gate == "hard",
            self,
        )

    def _params(self, device: torch.device) -> dict[str, Tensor]:
        params = self._on.get(device)
        if params is None:
            params = {name: t.to(device) for name, t in self._cpu.items()}
            self._on[device] = params
        return params

    def correction(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Return (float32 correction to subtract, boolean open mask (..., K))."""
        p = self._params(hidden.device)
        h = hidden.float()
        s = torch.matmul(h, p["probe_t"]) - p["offset"]
        eps = p["thresholds"]
        if self.gate == "hard":
            is_open = s.abs() > eps
        elif self.gate == "relu":
            is_open = s > eps
        else:
            is_open = torch.ones_like(s, dtype=torch.bool)
        # The response beyond the gate: what the ridge coefficient pulls back to the threshold
        # and what the one-sided ReLU gate of the appendix subtracts.
        if self.gate == "hard":
            beyond = s - torch.sign(s) * eps
        elif self.gate == "relu":
            beyond = s - eps
        else:
            beyond = s
        if self.coefficient == "projection":
            coef = beyond if self.gate == "relu" else s  # Algorithm 1 subtracts s_k v_k
        elif self.coefficient == "ridge":
            coef = p["scale"] * beyond
        else:
            coef = p["scale"].expand_as(s)
        coef = coef * is_open
        return torch.matmul(coef, p["steer"]), is_open

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        # Runs once per block call, i.e. once per generated token. On a small model's decode
        # step the checks below cost about a third of the hook, so after one checked call the
        # fused steer runs from a closure over that device's tensors and that call's dtype. It
        # computes exactly what the checked path does; anything it was not built for (another
        # device, dtype or hidden size) fails inside torch, or at its dtype check, before any
        # result exists and is handed to the checked path, which steers it or says what is
        # wrong, and the closure is dropped.
        fast = self._fast
        if fast is not None:
            kind = type(output)
            try:
                if kind is Tensor:  # transformers 5 blocks
                    return fast(output)
                if kind is tuple:  # transformers 4: (hidden, cache, ...)
                    return (fast(output[0]), *output[1:])
            except (RuntimeError, AttributeError, IndexError):
                self._fast, self._fast_failed = None, True
        plain = isinstance(output, Tensor)
        hidden, rebuild = (output, None) if plain else split_block_output(output)
        if hidden.shape[-1] != self.hidden_size:
            raise GSSError(
                f"the hooked block outputs hidden size {hidden.shape[-1]} but the steer was "
                f"calibrated for {self.hidden_size}: the artifact belongs to another model or "
                "layer."
            )
        steered, is_open = self.steer_hidden(hidden)
        if self.track_gates and is_open is not None:
            self._count(is_open)
        elif (
            self._fused
            and not self._fast_failed
            and (plain or type(output) is tuple)
            and hidden.dtype.is_floating_point
        ):
            self._fast = self._fused_closure(hidden.device, hidden.dtype)
        return steered if rebuild is None else rebuild(steered)

    def _fused_closure(
        self, device: torch.device, dtype: torch.dtype
    ) -> Callable[[Tensor], Tensor]:
        """The fused steer of `steer_hidden` for `dtype` tensors on `device`, in as few Python
        operations as it takes: the same kernels in the same order, or, with ``cuda_kernel``
        on a GPU, one Triton kernel (equal to float rounding: it sums in another order) in
        eager code and the same ops in code ``torch.compile`` traces, which it fuses itself.
        ``cpu_kernel``'s compiled hook runs before this, not in it (`forward_hook`)."""
        f = self._params(device)
        probe_t, neg_offset, neg_steer = (
            f["fused_probe_t"],
            f["fused_neg_offset"],
            f["fused_neg_steer"],
        )
        addmm = torch.addmm
        shrink = torch.nn.functional.hardshrink if self.gate == "hard" else _ungated

        ops: Callable[[Tensor], Tensor]
        if dtype == torch.float32:

            def steer(hidden: Tensor) -> Tensor:
                h = hidden.view(-1, hidden.shape[-1])  # a wrong width fails in addmm
                return addmm(h, shrink(addmm(neg_offset, h, probe_t), 1.0), neg_steer).view_as(
                    hidden
                )

            ops = steer
        else:

            def steer_cast(hidden: Tensor) -> Tensor:
                # .float() takes any dtype, so another one is refused here rather than cast
                # back to the wrong one
                if hidden.dtype is not dtype:
                    raise _NotBuiltFor(f"built for {dtype}, got {hidden.dtype}")
                h = hidden.view(-1, hidden.shape[-1]).float()
                out = addmm(h, shrink(addmm(neg_offset, h, probe_t), 1.0), neg_steer)
                return out.to(dtype).view_as(hidden)

            ops = steer_cast

        if self._cuda_kernel is not None and device.type == "cuda":
            fused_kernel = self._cuda_kernel(probe_t, neg_offset, neg_steer, self.gate == "hard")
            is_compiling = torch.compiler.is_compiling

            def steer_kernel(hidden: Tensor) -> Tensor:
                if is_compiling():  # a compiled graph gets the ops: its compiler fuses them
                    return ops(hidden)
                # another device or width raises a RuntimeError: the checked path
                return fused_kernel(hidden)

            return steer_kernel
        return ops

    def steer_hidden(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """The steered hidden states (in their dtype) and the open mask (..., K), or None when
        gates are not tracked and the steer runs fused.

        The paper's case (projection coefficient, hard gate or none) runs as two fused
        multiply-adds with a hardshrink between them when gates are not tracked (with tracking:
        a mask instead), a third of the kernels of `correction`: the hook runs once per
        generated token, where small models spend only milliseconds per step.
        """
        if self._fused and not self.track_gates:
            f = self._params(hidden.device)
            h = hidden.reshape(-1, hidden.shape[-1])  # a wrong width fails in addmm, never reshapes
            h = h if h.dtype == torch.float32 else h.float()
            s = torch.addmm(f["fused_neg_offset"], h, f["fused_probe_t"])
            if self.gate == "hard":
                s = torch.nn.functional.hardshrink(s, 1.0)
            # view_as, not view(hidden.shape): parsing a torch.Size costs ~10 us a call on CPU,
            # a fifth of this hook on a small model's decode step
            out = torch.addmm(h, s, f["fused_neg_steer"]).view_as(hidden)
            return (out if out.dtype == hidden.dtype else out.to(hidden.dtype)), None
        if self.coefficient != "projection" or self.gate == "relu":
            delta, is_open = self.correction(hidden)
            return (hidden.float() - delta).to(hidden.dtype), is_open
        p = self._params(hidden.device)
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-1]).float()
        s = torch.addmm(p["neg_offset"], h, p["probe_t"])
        open_mask: Tensor | None = None
        if self.gate == "hard":
            open_mask = s.abs() > p["thresholds"]
            s = s * open_mask
        elif self.track_gates:
            open_mask = torch.ones_like(s, dtype=torch.bool)
        steered = torch.addmm(h, s, p["steer"], alpha=-1.0).view_as(hidden).to(hidden.dtype)
        return steered, None if open_mask is None else open_mask.reshape(*shape[:-1], -1)

    def _count(self, is_open: Tensor) -> None:
        flat = is_open.reshape(-1, is_open.shape[-1])
        counts = flat.sum(0)
        any_open = flat.any(-1).sum()
        if (
            self.open_counts is None
            or self.any_open_count is None  # always set together with open_counts
            or self.open_counts.device != flat.device
        ):
            self.open_counts = torch.zeros_like(counts)
            self.any_open_count = torch.zeros_like(any_open)
            self.token_count = 0
        self.open_counts += counts
        self.any_open_count += any_open
        self.token_count += flat.shape[0]  # known on the host: no device copy

    def gate_stats(self) -> dict[str, Any]:
        """Share of tokens on which each direction's gate (and any gate) opened."""
        if self.open_counts is None or self.any_open_count is None or not self.token_count:
            return {"tokens": 0, "open_share": [], "any_open_share": 0.0}
        n = self.token_count
        return {
            "tokens": n,
            "open_share": (self.open_counts.double() / n).tolist(),
            "any_open_share": float(self.any_open_count.item()) / n,
        }

    def reset_stats(self) -> None:
        self.open_counts = self.any_open_count = None
        self.token_count = 0


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

    ``traced`` is what runs while ``torch.compile`` traces the block, where ``hook`` is a
    compiled C function that dynamo cannot read (``cpu_kernel``): the Python steer it stands
    for, so compiled code holds the steer's ops in its graph instead of breaking it there.
    """

    def __init__(
        self, block: nn.Module, hook: Callable[..., Any], traced: Callable[..., Any] | None = None
    ) -> None:
        self.install(block, hook, traced)

    def install(
        self, block: nn.Module, hook: Callable[..., Any], traced: Callable[..., Any] | None = None
    ) -> None:
        """Put this wrapper on ``block`` with ``hook`` (it must not be installed anywhere)."""
        self.block: nn.Module | None = block
        self.hook = hook
        self.traced = hook if traced is None else traced
        self.forward: Callable[..., Any] | None = block.forward  # instance attribute or method
        self._had_instance_forward = "forward" in block.__dict__
        block.forward = self

    @property
    def installed(self) -> bool:
        return self.block is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.forward(*args, **kwargs)  # type: ignore[misc]  # None only once removed
        hook = self.hook
        if hook is not self.traced and torch.compiler.is_compiling():
            hook = self.traced
        steered = hook(self.block, args, output)
        return output if steered is None else steered

    def remove(self) -> None:
        block = self.block
        if block is None:
            return
        self.hook = self.traced = _unchanged
        if block.__dict__.get("forward") is not self:
            return  # wrapped again since: stay in the chain, steer nothing
        if self._had_instance_forward:
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

    @property
    def active(self) -> bool:
        return self._handle is not None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

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
    searched for compiled code that would not run the steer (the block alone when None). A
    :class:`GatedSteer` built with ``cpu_kernel`` runs its compiled C hook there."""
    refuse_if_compiled(block if model is None else model)
    wrapped = hook.forward_hook() if isinstance(hook, GatedSteer) else hook
    last = block.__dict__.get(_LAST_WRAPPER)
    if isinstance(last, SteeredForward) and not last.installed:
        last.install(block, wrapped, traced=hook)  # the one compiled code knows
        return SteerHandle(hook, last)
    wrapper = SteeredForward(block, wrapped, traced=hook)
    # kept unless the last one still steers: a pass-through left in a chain never comes off
    if not isinstance(last, SteeredForward) or last.hook is _unchanged:
        block.__dict__[_LAST_WRAPPER] = wrapper  # not nn.Module's setattr: no submodule
    return SteerHandle(hook, wrapper)
