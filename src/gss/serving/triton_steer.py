"""The vLLM op's steer on CUDA as one Triton kernel: each token's row read once, its probe
responses, gate and steer computed in registers, and which tokens are steered written beside.

Inside vLLM's CUDA graphs the op's torch form costs five small kernels at the steered layer
(the add of hidden and residual, ``slots == slot``, addmm, hardshrink, addmm), each a node
of the graph: at one sequence, a decode step of SmolLM2-135M's shape on an H200 took ~0.015 ms
more with the steer on than without, 1.5% of the step (results/serve-op-share-cuda-2). The
arithmetic is `gss.steering.gated._fused_steer`'s (the same folded tensors, float32), the
sums taken in another order, so a steered token may differ from the torch form in the last
bits; an unsteered token is never touched (the layer keeps its outputs).

Only imported where Triton is (vLLM's CUDA install brings it); `vllm_plugin` falls back to
the torch form elsewhere, for a steer the kernel does not take, where the kernel does not
compile (with a warning), and with ``GSS_VLLM_TRITON=0``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The hidden states' dtypes the kernel takes."""
# columns x directions a program holds at once (wider rows are read in chunks): 32 floats a
# thread at 4 warps. Compiled for an H100/H200 (sm_90, ptxas, no GPU needed): 80 registers and
# no spill at rank 4; a 16 x 2048 tile took all 255 and spilled, a 64 x 2048 one 1.5 kB a thread
_TILE = 4096


@triton.jit
def _block_output(hidden_row, residual_row, cols, ok, HAS_RESIDUAL: tl.constexpr):
    """Columns ``cols`` of a token's block output: its hidden (+ residual, the sum rounded to
    their dtype as torch's add rounds it)."""
    x = tl.load(hidden_row + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_row + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(hidden_row.dtype.element_ty)
    return x


@triton.jit
def _steer_rows(
    hidden_ptr,
    residual_ptr,
    out_ptr,
    hit_ptr,
    slots_ptr,
    probe_ptr,
    neg_offset_ptr,
    neg_steer_ptr,
    slot,
    width,
    stride_hidden,
    stride_residual,
    stride_out,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HARD: tl.constexpr,
    PASS_THROUGH: tl.constexpr,
):
    """One program a token: ``x = hidden (+ residual)``; where the token's slot is ``slot``,
    ``out = x + shrink(P x + b) @ S`` (P: probe rows over eps, b: minus offset over eps, S:
    minus steer rows times eps; shrink: hardshrink at 1, or none), else ``out = x`` if
    ``PASS_THROUGH`` (another artifact follows) or nothing."""
    row = tl.program_id(0).to(tl.int64)
    hidden_row = hidden_ptr + row * stride_hidden
    residual_row = residual_ptr + row * stride_residual
    mine = tl.load(slots_ptr + row) == slot
    tl.store(hit_ptr + row, mine)
    ks = tl.arange(0, K_PAD)
    k_ok = ks < K
    if mine:
        response = tl.zeros((K_PAD,), dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < width
            x = _block_output(hidden_row, residual_row, cols, ok, HAS_RESIDUAL)
            tile = ks[:, None] * width + cols[None, :]
            probe = tl.load(probe_ptr + tile, mask=k_ok[:, None] & ok[None, :], other=0.0)
            response += tl.sum(probe * x.to(tl.float32)[None, :], axis=1)
        response += tl.load(neg_offset_ptr + ks, mask=k_ok, other=0.0)
        if HARD:
            response = tl.where(tl.abs(response) > 1.0, response, 0.0)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < width
            x = _block_output(hidden_row, residual_row, cols, ok, HAS_RESIDUAL)
            tile = ks[:, None] * width + cols[None, :]
            steer = tl.load(neg_steer_ptr + tile, mask=k_ok[:, None] & ok[None, :], other=0.0)
            y = x.to(tl.float32) + tl.sum(response[:, None] * steer, axis=0)
            tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
    elif PASS_THROUGH:
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < width
            x = _block_output(hidden_row, residual_row, cols, ok, HAS_RESIDUAL)
            tl.store(out_ptr + row * stride_out + cols, x, mask=ok)


class TritonSteer:
    """One artifact's fused steer (`GatedSteer`'s folded tensors, on one device) as a launch
    of `_steer_rows` over a block output's rows."""

    def __init__(self, probe: Tensor, neg_offset: Tensor, neg_steer: Tensor, *, hard: bool):
        self.probe = probe.float().contiguous()  # (K, d): probe rows over eps
        self.neg_offset = neg_offset.float().contiguous()  # (K,)
        self.neg_steer = neg_steer.float().contiguous()  # (K, d)
        self.hard = hard
        self.rank, self.width = self.probe.shape
        self.rank_pad = max(triton.next_power_of_2(self.rank), 2)
        self.block = min(triton.next_power_of_2(self.width), max(_TILE // self.rank_pad, 16))

    def __call__(
        self,
        hidden: Tensor,
        residual: Tensor | None,
        slots: Tensor,
        slot: int,
        *,
        pass_through: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """(rows x d) ``hidden`` (+ ``residual``) steered on the rows whose entry of ``slots``
        is ``slot`` (the others: unsteered with ``pass_through``, else undefined), and those
        rows (bool, rows x 1)."""
        rows = hidden.shape[0]
        out = torch.empty_like(hidden)
        hit = torch.empty((rows, 1), dtype=torch.bool, device=hidden.device)
        if rows == 0:
            return out, hit
        extra = hidden if residual is None else residual
        _steer_rows[(rows,)](
            hidden,
            extra,
            out,
            hit,
            slots,
            self.probe,
            self.neg_offset,
            self.neg_steer,
            slot,
            self.width,
            hidden.stride(0),
            extra.stride(0),
            out.stride(0),
            K=self.rank,
            K_PAD=self.rank_pad,
            BLOCK=self.block,
            HAS_RESIDUAL=residual is not None,
            HARD=self.hard,
            PASS_THROUGH=pass_through,
            num_warps=4,
        )
        return out, hit
