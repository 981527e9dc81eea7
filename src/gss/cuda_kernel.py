"""The fused steer as one Triton kernel: a CUDA decode step pays one launch instead of five.

On a GPU a small model's decode step is bound by kernel launches, not arithmetic, and the
steer's ATen path launches five (cast to float32, two matrix products, the gate, cast back).
This kernel reads each row of hidden states, computes its K gated probe responses and writes
the steered row in the input's dtype, all in float32 registers. Rows beyond ``SMALL_ROWS``
(prompt passes), inputs that need a gradient and strided ones go to the ATen path, where
cuBLAS is the better choice. Triton ships with PyTorch's CUDA builds; the kernel is compiled
on its first call (then cached by Triton), nothing ahead of time. Measured on an H100: 28-52
us a decode-step call against 74-115 us for the five kernels (docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

from .errors import GSSError

SMALL_ROWS = 64  # more rows than this (a prompt pass) take the ATen ops


@cache
def load() -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, bool], Tensor]:
    """The fused steer ``steer(h, probe_t (d, K), probe (K, d), neg_offset (K,), neg_steer
    (K, d), hard)`` (the probes in both layouts: the ATen path's and the kernel's rows);
    raises GSSError when Triton or CUDA is missing."""
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

    shrink = torch.nn.functional.hardshrink

    def steer(
        h: Tensor,
        probe_t: Tensor,
        probe: Tensor,
        neg_offset: Tensor,
        neg_steer: Tensor,
        hard: bool,
    ) -> Tensor:
        d = h.shape[-1]
        x = h.view(-1, d)  # a wrong width or a non-contiguous input fails here
        rows, k = x.shape[0], probe.shape[0]
        if rows > SMALL_ROWS or x.requires_grad or not x.is_contiguous():
            xf = x.float()
            s = torch.addmm(neg_offset, xf, probe_t)  # the same call as GatedSteer's
            s = shrink(s, 1.0) if hard else s
            return torch.addmm(xf, s, neg_steer).to(h.dtype).view_as(h)
        if probe.shape[1] != d or x.device != probe.device:
            raise RuntimeError(f"steer built for width {probe.shape[1]} on {probe.device}")
        out = torch.empty_like(x)
        block_k = max(2, triton.next_power_of_2(k))
        block_d = min(triton.next_power_of_2(d), max(128, 8192 // block_k))
        _steer_rows[(rows,)](
            x, out, probe, neg_offset, neg_steer, d, k, HARD=hard, BLOCK_D=block_d, BLOCK_K=block_k
        )
        return out.view_as(h)

    return steer
