"""The fused steer as one Triton kernel: a CUDA decode step pays one launch instead of five.

On a GPU a small model's decode step is bound by kernel launches, not arithmetic, and the
steer's ATen path launches five (cast to float32, two matrix products, the gate, cast back).
This kernel reads each row of hidden states, computes its K gated probe responses and writes
the steered row in the input's dtype, all in float32 registers. Rows beyond ``SMALL_ROWS``
(prompt passes), inputs that need a gradient and strided ones go to the ATen path, where
cuBLAS is the better choice. Triton ships with PyTorch's CUDA builds; the kernel is compiled
on its first call (then cached by Triton), nothing ahead of time.

Triton's own launch (``kernel[grid](...)``) binds and specialises its arguments in Python on
every call, which costs more host time than the kernel takes on the GPU. A steer's parameters
never change, so `BoundSteer` launches the compiled kernel directly after its first call: the
same call Triton makes last, with the same arguments, once a test launch has written the same
bits as Triton's. Where that launcher takes other arguments (another Triton version) or
differs, it keeps Triton's launch. Measured on an H100: docs/scaling.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import Tensor

from gss.errors import GSSError

SMALL_ROWS = 64  # more rows than this (a prompt pass) take the ATen ops
ALIGN = 16  # bytes: Triton specialises a pointer on this alignment (its first call's)

Launch = Callable[[int, Tensor, Tensor], None]


@cache
def _triton_kernel() -> tuple[Any, Any]:
    """(triton, the jitted row kernel); GSSError when Triton or CUDA is missing."""
    if not torch.cuda.is_available():
        raise GSSError(
            "the CUDA steer kernel needs a CUDA GPU, and torch.cuda.is_available() is False; "
            "attach without cuda_kernel."
        )
    try:
        import triton
        import triton.language as tl
    except ImportError as err:
        raise GSSError(
            f"the CUDA steer kernel is written in Triton, which is not importable here ({err}); "
            "PyTorch's CUDA wheels install it: pip install triton, or attach without "
            "cuda_kernel."
        ) from None

    @triton.jit
    def _steer_rows(  # no annotations: Triton reads them itself
        h_ptr,
        out_ptr,
        probe_ptr,
        offset_ptr,
        steer_ptr,
        d,
        k,
        HARD: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < k
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, d, BLOCK_D):
            ds = start + tl.arange(0, BLOCK_D)
            d_ok = ds < d
            h = tl.load(h_ptr + row * d + ds, mask=d_ok, other=0.0).to(tl.float32)
            p = tl.load(
                probe_ptr + ks[:, None] * d + ds[None, :],
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc += tl.sum(p * h[None, :], axis=1)
        s = acc + tl.load(offset_ptr + ks, mask=k_ok, other=0.0)
        if HARD:  # hardshrink(s, 1): thresholds are folded into the probes
            s = tl.where(tl.abs(s) > 1.0, s, 0.0)
        for start in range(0, d, BLOCK_D):
            ds = start + tl.arange(0, BLOCK_D)
            d_ok = ds < d
            h = tl.load(h_ptr + row * d + ds, mask=d_ok, other=0.0).to(tl.float32)
            v = tl.load(
                steer_ptr + ks[:, None] * d + ds[None, :],
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            out = h + tl.sum(v * s[:, None], axis=0)
            tl.store(out_ptr + row * d + ds, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    return triton, _steer_rows


class BoundSteer:
    """The fused steer ``h + hardshrink(h @ probe_t + neg_offset, 1) @ neg_steer`` (no
    hardshrink when ``hard`` is False) for one device's float32 parameters: ``probe_t`` (d, K),
    ``neg_offset`` (K,), ``neg_steer`` (K, d). Called with hidden states (..., d) of any float
    dtype on that device; returns the steered states in their dtype. A tensor on another
    device, or of another width, raises a RuntimeError before anything is launched.

    ``direct_launch=False`` keeps Triton's own launch on every call (for measuring it).
    ``launch`` is the direct launcher once the first call has checked it, else None.
    """

    def __init__(
        self,
        probe_t: Tensor,
        neg_offset: Tensor,
        neg_steer: Tensor,
        hard: bool,
        direct_launch: bool = True,
    ) -> None:
        triton, self._kernel = _triton_kernel()
        if probe_t.device.type != "cuda":
            raise GSSError(
                f"the CUDA steer kernel needs its parameters on a GPU, not {probe_t.device}."
            )
        self.d, self.k = probe_t.shape
        self.probe_t, self.neg_offset, self.neg_steer = probe_t, neg_offset, neg_steer
        self.hard = hard
        self.probe = probe_t.t().contiguous()  # (K, d): the kernel reads the probes as rows
        self.device_index: int = probe_t.device.index or 0
        block_k = max(2, triton.next_power_of_2(self.k))
        block_d = min(triton.next_power_of_2(self.d), max(128, 8192 // block_k))
        self._args = (self.probe, neg_offset, neg_steer, self.d, self.k)
        self._constexprs = {"HARD": hard, "BLOCK_D": block_d, "BLOCK_K": block_k}
        self.launch: Launch | None = None
        self._check_direct = direct_launch

    def aten(self, x: Tensor) -> Tensor:
        """The same steer in ATen ops (rows (n, d)): prompt passes, gradients, strided rows."""
        xf = x.float()
        s = torch.addmm(self.neg_offset, xf, self.probe_t)  # the same call as GatedSteer's
        s = torch.nn.functional.hardshrink(s, 1.0) if self.hard else s
        return torch.addmm(xf, s, self.neg_steer).to(x.dtype)

    def __call__(self, h: Tensor) -> Tensor:
        x = h.view(-1, self.d)  # a wrong width or a non-contiguous input fails here
        rows = x.shape[0]
        if rows > SMALL_ROWS or x.requires_grad or not x.is_contiguous():
            return self.aten(x).view_as(h)
        if x.get_device() != self.device_index:  # -1 on a CPU
            raise RuntimeError(f"steer built for cuda:{self.device_index}, got {x.device}")
        out = torch.empty_like(x)
        launch = self.launch
        if launch is not None and x.data_ptr() % ALIGN == 0:
            if torch.cuda.current_device() == self.device_index:
                launch(rows, x, out)
            else:
                with torch.cuda.device(self.device_index):
                    launch(rows, x, out)
        else:
            self._triton_launch(rows, x, out)
        return out.view_as(h)

    def _triton_launch(self, rows: int, x: Tensor, out: Tensor) -> None:
        with torch.cuda.device(self.device_index):
            compiled = self._kernel[(rows,)](x, out, *self._args, **self._constexprs)
            if self._check_direct and x.data_ptr() % ALIGN == 0:
                self._check_direct = False
                self.launch = self._direct_launcher(compiled, rows, x, out)

    def _direct_launcher(self, compiled: Any, rows: int, x: Tensor, out: Tensor) -> Launch | None:
        """The compiled kernel's own launcher with this steer's arguments bound, if it writes
        what Triton's launch just wrote into ``out`` (bit for bit); else None. Triton versions
        differ in whether the launcher takes the constexpr arguments too, so both layouts are
        tried, and one that raises or writes other bits is not kept. Triton's launch hooks
        (its profiler's) do not see direct launches."""
        run = getattr(compiled, "run", None)
        function = getattr(compiled, "function", None)
        metadata = getattr(compiled, "packed_metadata", None)
        stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if run is None or function is None or metadata is None or stream_of is None:
            return None
        index = self.device_index

        def bound(tail: tuple[Any, ...]) -> Launch:
            def launch(rows: int, x: Tensor, out: Tensor) -> None:
                # grid, stream, kernel, its metadata; no launch metadata or hooks; arguments
                run(
                    rows,
                    1,
                    1,
                    stream_of(index),
                    function,
                    metadata,
                    None,
                    None,
                    None,
                    x,
                    out,
                    *tail,
                )

            return launch

        trial = torch.empty_like(out)
        for tail in (self._args + tuple(self._constexprs.values()), self._args):
            launch = bound(tail)
            try:
                launch(rows, x, trial)
            except (TypeError, ValueError, RuntimeError, SystemError):
                continue
            if torch.equal(trial, out):
                return launch
        return None


def load() -> Callable[..., BoundSteer]:
    """`BoundSteer`'s constructor, once Triton and CUDA are known to be there: raises
    GSSError (with the fix) when they are not."""
    _triton_kernel()
    return BoundSteer
