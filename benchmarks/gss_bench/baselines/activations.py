"""Token activations of one decoder block over a set of rows, for the activation baselines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gss.hf.blocks import find_decoder_blocks, resolve_layer
from gss.hf.forward import forward_logits
from gss.steering.attach import split_block_output
from gss_bench.baselines.mlp import mlp_layers
from gss_bench.baselines.training import row_batches


def default_layer(model: nn.Module, layer: int | None) -> int:
    """`layer`, or the middle block (LUNAR's default) when None; validated."""
    n = len(find_decoder_blocks(model))
    index, _ = resolve_layer(model, n // 2 if layer is None else layer)
    return index


@dataclass(frozen=True)
class BlockActivations:
    """Per token (real tokens only, rows concatenated): the block output and, if asked, the
    MLP neurons (input of its output projection); `row` maps each token to its row."""

    output: Tensor  # (N, d) float32
    row: Tensor  # (N,) long
    neurons: Tensor | None = None  # (N, width) float32

    def row_means(self) -> Tensor:
        """(rows, d) mean block output of each row."""
        n = int(self.row.max()) + 1
        sums = torch.zeros(n, self.output.shape[1]).index_add_(0, self.row, self.output)
        return sums / torch.bincount(self.row, minlength=n).unsqueeze(1).float()


@torch.no_grad()
def block_activations(
    model: nn.Module,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    layer: int,
    neurons: bool = False,
    batch_size: int = 64,
) -> BlockActivations:
    """One forward pass over `rows`, reading block `layer` (kept on the host, float32)."""
    _, block = resolve_layer(model, layer)
    seen: dict[str, Tensor] = {}

    def read_output(module: nn.Module, args: tuple, output: object) -> None:
        seen["output"] = split_block_output(output)[0]

    def read_neurons(module: nn.Module, args: tuple) -> None:
        seen["neurons"] = args[0]

    handles = [block.register_forward_hook(read_output)]
    if neurons:
        handles.append(mlp_layers(model)[layer].down.register_forward_pre_hook(read_neurons))
    collected: dict[str, list[Tensor]] = {"output": [], "neurons": [], "row": []}
    try:
        start = 0
        for ids, mask in row_batches(rows, batch_size, pad_id):
            forward_logits(model, ids, mask)
            keep = mask.bool()
            for name, value in seen.items():
                collected[name].append(value[keep.to(value.device)].float().cpu())
            rows_of = torch.arange(start, start + len(ids)).unsqueeze(1).expand_as(mask)
            collected["row"].append(rows_of[keep])
            start += len(ids)
    finally:
        for h in handles:
            h.remove()
    return BlockActivations(
        output=torch.cat(collected["output"]),
        row=torch.cat(collected["row"]),
        neurons=torch.cat(collected["neurons"]) if neurons else None,
    )
