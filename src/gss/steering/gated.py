"""The gated subspace steer's arithmetic and its gate counters: the one implementation that
``attach``, ``gss.steer``, generate, evaluate and sweep all run.

Per token, the hook computes all K probe responses ``s = U h - b`` with one matmul, opens the
gate of direction k where the response passes its threshold, and subtracts
``sum_k c_k v_k`` from the block output. Everything is computed in float32 and cast back to the
activation dtype; a token whose gates all stay closed gets a correction of exactly zero, so its
output is bit-for-bit unchanged. The hook does no host synchronisation and no Python branching
on tensor values, so it runs the same under ``generate``, the KV cache, CUDA graphs and
``torch.compile`` (attached before compiling or after: see ``compiled.py``).

It has two forms, each written once. The paper's case (the projection coefficient with the hard
gate, every threshold positive and finite, or with no gate) is fused (`_fused_steer`): three
ops a call, the form every decode step of a small model pays for. Everything else is
`GatedSteer.correction`. Tracking the gates counts them beside the same arithmetic, so it never
changes the output. How a steer is put on a block is ``attach.py``; this module knows nothing
about artifacts or files: it takes tensors and options.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gss.config import COEFFICIENTS, GATES, Coefficient, Gate
from gss.errors import GSSError
from gss.steering.attach import split_block_output

# (steered hidden states in their dtype, gated responses (rows, K): zero where a gate is closed)
FusedSteer = Callable[[Tensor], tuple[Tensor, Tensor]]


class _NotBuiltFor(RuntimeError):
    """A tensor the hook's fast path was not built for: the checked path takes it."""


def _ungated(s: Tensor, _lambd: float) -> Tensor:
    return s


def _fused_steer(
    probe_t: Tensor, neg_offset: Tensor, neg_steer: Tensor, *, hard: bool, dtype: torch.dtype
) -> FusedSteer:
    """The fused steer of ``dtype`` hidden states, bound to one device's tensors.

    The probe rows and offsets come divided by eps_k and the negated steer rows multiplied by
    it, so the hard gate is one hardshrink at 1 (exactly 0 where closed) between two
    multiply-adds, in float32. Built once per device and dtype and called with no other Python
    around it (`GatedSteer.__call__`): on a small model's decode step the checks of the checked
    path cost about a third of the hook. Returns the steered rows and the gated responses.
    Anything else fails before any result exists: another dtype at the check below (or, in
    float32, in addmm: ``.float()`` would take it and cast back to the wrong one), another
    device or width inside torch.
    """
    addmm = torch.addmm
    shrink = torch.nn.functional.hardshrink if hard else _ungated
    widen = dtype != torch.float32

    def steer(hidden: Tensor) -> tuple[Tensor, Tensor]:
        h = hidden.view(-1, hidden.shape[-1])  # not reshape: 0.1-0.3 us less a call
        if widen:
            if hidden.dtype is not dtype:
                raise _NotBuiltFor(f"built for {dtype}, got {hidden.dtype}")
            h = h.float()
        s = shrink(addmm(neg_offset, h, probe_t), 1.0)
        # view_as, not view(hidden.shape): parsing a torch.Size costs ~10 us a call on CPU,
        # a fifth of this hook on a small model's decode step
        out = addmm(h, s, neg_steer).view_as(hidden)
        return (out.to(dtype) if widen else out), s

    return steer


def resolve_device(device: torch.device | str) -> torch.device:
    """``cuda`` as the device it means now (``cuda:N``), as tensors report it: a cache keyed by
    device must not see ``cuda`` and ``cuda:0`` as two devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_steer(
    probe: Tensor,
    steer: Tensor,
    thresholds: Tensor,
    gate: str,
    coefficient: str,
    condition: Tensor | None,
    condition_threshold: float | None,
) -> None:
    """Refuse a `GatedSteer` whose options or tensor shapes do not fit together, before any
    tensor is made from them."""
    if gate not in GATES:
        raise GSSError(f"gate must be one of {GATES}, got {gate!r}.")
    if coefficient not in COEFFICIENTS:
        raise GSSError(f"coefficient must be one of {COEFFICIENTS}, got {coefficient!r}.")
    if probe.ndim != 2 or steer.shape != probe.shape:
        raise GSSError(
            f"probe and steer must both be (K, d); got {tuple(probe.shape)} and "
            f"{tuple(steer.shape)}."
        )
    k = probe.shape[0]
    if (gate == "discriminant") != (condition is not None and condition_threshold is not None):
        raise GSSError(
            "the discriminant gate needs a condition direction and its threshold, and only "
            "it takes them: calibrate with gate='discriminant', or pick another gate."
        )
    if thresholds.shape != (k,):
        raise GSSError(f"thresholds must have shape ({k},), got {tuple(thresholds.shape)}.")


def _scale(
    probe32: Tensor,
    steer32: Tensor,
    coefficient: str,
    delta: float,
    ridge_delta: float | None,
    min_alignment: float,
) -> Tensor:
    """The factor each direction's coefficient is scaled by (K,): the paper's constant or
    the ridge's, from the alignment <u_k, v_k>; ones for the others."""
    alignment = (probe32 * steer32).sum(-1)
    if coefficient == "paper-constant":
        return alignment / (alignment**2 + delta)
    if coefficient == "ridge":
        rd = delta if ridge_delta is None else ridge_delta
        scale = alignment / (alignment**2 + rd)
        usable = alignment.abs() >= min_alignment * probe32.norm(dim=-1).clamp_min(1e-30)
        return torch.where(usable, scale, torch.zeros_like(scale))
    return torch.ones(probe32.shape[0])


def _fused_tensors(
    probe32: Tensor,
    steer32: Tensor,
    offset32: Tensor,
    eps32: Tensor,
    gate: str,
    coefficient: str,
) -> dict[str, Tensor] | None:
    """The fused form's folded tensors (`_fused_steer`), or None where it does not take the
    steer: another coefficient or gate, a threshold not positive and finite, or folded
    tensors that would not be finite."""
    k = probe32.shape[0]
    positive = bool(((eps32 > 0) & torch.isfinite(eps32)).all())
    if not (coefficient == "projection" and (gate == "none" or (gate == "hard" and positive))):
        return None
    unit = eps32 if gate == "hard" else torch.ones(k)
    fused = {
        "fused_probe_t": (probe32 / unit[:, None]).t().contiguous(),
        "fused_neg_offset": -offset32 / unit,
        "fused_neg_steer": (-steer32 * unit[:, None]).contiguous(),
    }
    if all(bool(torch.isfinite(t).all()) for t in fused.values()):
        return fused
    return None


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
            (c_k = <u,v>/(<u,v>^2 + delta), as printed in the main text) or ``"bounded"``
            (c_k = s_k clipped so that it removes at most the hidden state's own component
            along v_k, never pushing it past zero: with orthonormal steer directions the
            correction is never larger than the hidden state it corrects, issue 72).
        delta: the variance budget, used by ``paper-constant``.
        ridge_delta: the ridge regulariser of ``ridge`` (defaults to ``delta``).
        min_alignment: ``ridge`` (a paper ablation) skips directions whose
            |<u_k, v_k>| / ||u_k|| is below this, where the coefficient would blow up.
        condition: (d,) the ``discriminant`` gate's condition direction w, with
            ``condition_threshold``: every gate opens where ``w . h`` passes it
            (`gss.solve.condition`); the coefficient is then the response s_k itself.
        track_gates: count how often each direction's gate opens (on device, no sync).
    """

    def __init__(
        self,
        probe: Tensor,
        steer: Tensor,
        thresholds: Tensor,
        offset: Tensor | None = None,
        *,
        gate: Gate = "hard",
        coefficient: Coefficient = "projection",
        delta: float = 1.0,
        ridge_delta: float | None = None,
        min_alignment: float = 1e-3,
        track_gates: bool = False,
        condition: Tensor | None = None,
        condition_threshold: float | None = None,
    ) -> None:
        _check_steer(probe, steer, thresholds, gate, coefficient, condition, condition_threshold)
        k = probe.shape[0]
        self.gate = gate
        self.coefficient = coefficient
        self.hidden_size = probe.shape[1]
        probe32 = probe.detach().float()
        steer32 = steer.detach().float()
        offset32 = torch.zeros(k) if offset is None else offset.detach().float().reshape(k)
        scale = _scale(probe32, steer32, coefficient, delta, ridge_delta, min_alignment)
        self._cpu = {
            "probe_t": probe32.t().contiguous(),
            "steer": steer32.contiguous(),
            "thresholds": thresholds.detach().float().clone(),
            "offset": offset32.clone(),
            "scale": scale.float(),
        }
        if condition is not None and condition_threshold is not None:
            self._cpu["condition"] = condition.detach().float().reshape(-1, 1).contiguous()
            self._cpu["condition_threshold"] = torch.tensor([float(condition_threshold)])
        self._on: dict[torch.device, dict[str, Tensor]] = {}
        # The fused form (`_fused_steer`) takes the projection coefficient with the hard gate
        # (every threshold positive and finite) or none; a threshold that would make its folded
        # tensors non-finite (extreme) leaves the steer to `correction`, as do the other modes.
        fused = _fused_tensors(
            probe32, steer32, offset32, self._cpu["thresholds"], gate, coefficient
        )
        self._fused = fused is not None
        if fused is not None:
            self._cpu.update(fused)
        self._fused_by: dict[tuple[torch.device, torch.dtype], FusedSteer] = {}
        # the fused steer of the last checked call's device and dtype: what every decode step
        # runs (see __call__)
        self._fast: FusedSteer | None = None
        self._fast_failed = False
        self._track_gates = track_gates
        self.open_counts: Tensor | None = None
        self.token_count: Tensor | int = 0
        self.any_open_count: Tensor | None = None
        # the (B, S) attention mask of the model's current forward, when `count_real_tokens`
        # reads it: the counters then skip padding, so shares do not depend on the batching
        self.count_mask: Tensor | None = None
        # what the steer was made from (the artifact's probe): tells an artifact attached twice
        self.origin: object | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save`` of a steered model, a process that spawns) without the fused
        steers built for each device and dtype: closures, which pickle cannot take; the first
        call after loading builds them again."""
        state = self.__dict__.copy()
        state["_fused_by"], state["_fast"] = {}, None
        return state

    @property
    def track_gates(self) -> bool:
        """Count gate openings: every call then takes the checked path, which counts them."""
        return self._track_gates

    @track_gates.setter
    def track_gates(self, value: bool) -> None:
        self._track_gates = value
        self._fast = None

    def _params(self, device: torch.device) -> dict[str, Tensor]:
        params = self._on.get(device)
        if params is None:
            params = {name: t.to(device) for name, t in self._cpu.items()}
            self._on[device] = params
        return params

    def _fused_for(self, device: torch.device, dtype: torch.dtype) -> FusedSteer:
        steer = self._fused_by.get((device, dtype))
        if steer is None:
            p = self._params(device)
            steer = _fused_steer(
                p["fused_probe_t"],
                p["fused_neg_offset"],
                p["fused_neg_steer"],
                hard=self.gate == "hard",
                dtype=dtype,
            )
            self._fused_by[device, dtype] = steer
        return steer

    def folded(self, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor, bool] | None:
        """The fused form's tensors on ``device``: probe rows over eps (K x d), minus the
        offset over eps (K,), minus the steer rows times eps (K x d), and whether the gate is
        the hard one (a hardshrink at 1 between them; else none); None for a steer the fused
        form does not take, or one that counts its gates. What another implementation of the
        fused steer computes with (the vLLM plugin's Triton kernel)."""
        if not self._fused or self.track_gates:
            return None
        p = self._params(resolve_device(device))
        hard = self.gate == "hard"
        return p["fused_probe_t"].t(), p["fused_neg_offset"], p["fused_neg_steer"], hard

    def prepare(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Put the steer's tensors on ``device`` and build its fused form for ``dtype`` now,
        not at the first call: a first call inside a CUDA-graph capture (vLLM's, or inductor's
        cudagraph trees) would allocate them in the graph's private memory pool."""
        device = resolve_device(device)
        self._params(device)
        if self._fused:
            self._fused_for(device, dtype)

    def correction(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The general form: (float32 correction to subtract, boolean open mask (..., K))."""
        p = self._params(hidden.device)
        h = hidden.float()
        s = torch.matmul(h, p["probe_t"]) - p["offset"]
        eps = p["thresholds"]
        if self.gate == "hard":
            is_open = s.abs() > eps
        elif self.gate == "relu":
            is_open = s > eps
        elif self.gate == "discriminant":
            passed = torch.matmul(h, p["condition"]) > p["condition_threshold"]
            is_open = passed.expand_as(s)
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
        elif self.coefficient == "bounded":
            along = torch.matmul(h, p["steer"].t())  # the state's own component along each v_k
            coef = torch.minimum(torch.maximum(s, along.clamp(max=0.0)), along.clamp(min=0.0))
        else:
            coef = p["scale"].expand_as(s)
        # where, not a product: a closed gate's coefficient may be infinite (an infinite
        # threshold), and its correction must still be exactly 0
        coef = torch.where(is_open, coef, torch.zeros_like(coef))
        return torch.matmul(coef, p["steer"]), is_open

    def responses(self, hidden: Tensor) -> Tensor:
        """The probe responses ``s = U h - b`` (float32, (..., K)) of ``hidden``: what each
        gate compares with its threshold, computed as `correction` computes them. For reports
        (`gss.inference.explain`); the steer itself never calls it (its fused form reads the
        responses off tensors scaled by the thresholds)."""
        p = self._params(hidden.device)
        return torch.matmul(hidden.float(), p["probe_t"]) - p["offset"]

    def steer_hidden(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """The steered hidden states (in their dtype) and the open mask (..., K), or None when
        gates are not tracked and the steer runs fused. With tracking, the fused form's gates
        are read off its own gated responses (nonzero: open), so the output does not change."""
        if self._fused:
            fused = self._fused_for(hidden.device, hidden.dtype)
            try:
                steered, s = fused(hidden)  # what the fast path computes for this input
            except RuntimeError:  # strides that .view cannot take (or an error it repeats)
                steered, s = fused(hidden.contiguous())
            if not self.track_gates:
                return steered, None
            is_open = s != 0 if self.gate == "hard" else torch.ones_like(s, dtype=torch.bool)
            return steered, is_open.view(*hidden.shape[:-1], -1)
        delta, is_open = self.correction(hidden)
        return (hidden.float() - delta).to(hidden.dtype), is_open

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        # Runs once per block call, i.e. once per generated token. After one checked call the
        # fused steer of that call's device and dtype runs with no other Python around it.
        # Anything it was not built for (another device, dtype or hidden size) fails inside
        # torch, or at its dtype check, before any result exists and is handed to the checked
        # path, which steers it or says what is wrong, and the fast path is dropped.
        fast = self._fast
        if fast is not None:
            kind = type(output)
            try:
                if kind is Tensor:  # transformers 5 blocks
                    return fast(output)[0]
                if kind is tuple:  # transformers 4: (hidden, cache, ...)
                    return (fast(output[0])[0], *output[1:])
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
            self._fast = self._fused_for(hidden.device, hidden.dtype)
        return steered if rebuild is None else rebuild(steered)

    def _count(self, is_open: Tensor) -> None:
        flat = is_open.reshape(-1, is_open.shape[-1])
        real = flat.new_ones(flat.shape[0])
        mask = self.count_mask
        if (
            mask is not None
            and is_open.ndim == 3
            and mask.ndim == 2
            and mask.shape[0] == is_open.shape[0]
            and mask.shape[1] >= is_open.shape[1]
        ):  # the block's positions are the mask's last ones (earlier ones are in the KV cache)
            real = (mask[:, -is_open.shape[1] :] != 0).to(flat.device).reshape(-1)
        # products, not indexing: no shape that depends on the data, so no wait for the device
        counts = (flat & real[:, None]).sum(0)
        any_open = (flat.any(-1) & real).sum()
        if (
            self.open_counts is None
            or self.any_open_count is None  # always set together with open_counts
            or self.open_counts.device != flat.device
        ):
            self.open_counts = torch.zeros_like(counts)
            self.any_open_count = torch.zeros_like(any_open)
            self.token_count = torch.zeros_like(any_open)
        self.open_counts += counts
        self.any_open_count += any_open
        self.token_count += real.sum()

    def gate_stats(self) -> dict[str, Any]:
        """Share of tokens on which each direction's gate (and any gate) opened."""
        n = int(self.token_count)
        if self.open_counts is None or self.any_open_count is None or not n:
            return {"tokens": 0, "open_share": [], "any_open_share": 0.0}
        return {
            "tokens": n,
            "open_share": (self.open_counts.double() / n).tolist(),
            "any_open_share": float(self.any_open_count.item()) / n,
        }

    def reset_stats(self) -> None:
        self.open_counts = self.any_open_count = None
        self.token_count = 0


def count_real_tokens(model: nn.Module, steer: GatedSteer) -> RemovableHandle:
    """Hand ``steer`` the ``attention_mask`` of each forward of ``model`` (a forward pre-hook),
    so that its gate counters skip padding; remove the returned handle to stop."""

    def read_mask(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        steer.count_mask = mask if isinstance(mask, Tensor) else None

    return model.register_forward_pre_hook(read_mask, with_kwargs=True)
