"""Calibration across ``torch.distributed`` ranks (e.g. ``torchrun --nproc-per-node N``).

Each rank calibrates on its shard of the sequences; the streaming statistics are all-reduced,
rank 0 solves and broadcasts the directions, and the threshold samples of all ranks are
gathered, so every rank ends with the same artifact as one process over all the data. Without
an initialised process group every function here is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def shard(items: Sequence[T]) -> list[T]:
    """This rank's share of ``items`` (every world_size-th item)."""
    if not is_distributed():
        return list(items)
    return list(items[dist.get_rank() :: dist.get_world_size()])


def sum_counts(counts: dict[str, Any], keys: Sequence[str]) -> None:
    """All-reduce counters (integers, or float sums) in place."""
    if not is_distributed():
        return
    t = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    for k, v in zip(keys, t.tolist(), strict=True):
        counts[k] = int(v) if isinstance(counts[k], int) else v


def gather_rows(rows: Tensor) -> Tensor:
    """Concatenate every rank's rows (N_r, K) in rank order, on the CPU."""
    if not is_distributed():
        return rows
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows.cpu())
    return torch.cat(gathered)


def broadcast_tensors(*tensors: Tensor) -> list[Tensor]:
    """Rank 0's values of ``tensors`` on every rank."""
    if not is_distributed():
        return list(tensors)
    box: list[Any] = [[t.cpu() for t in tensors] if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return [t.to(orig.device) for t, orig in zip(box[0], tensors, strict=True)]
