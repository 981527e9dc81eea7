"""Which layer to steer: the memorization signal's strength at every candidate block, in one pass.

The strength at a block is the top singular value of its whitened memorization matrix
``Sigma_gen^{-1/2} M`` (the first-order change of the memorized tokens' objective per unit of
probe variance on general tokens; the paper's layer-selection figure). `scan_layers` gathers M
and Sigma_gen at all candidate blocks from the same forward and backward passes that a
calibration at one block runs: the lowest candidate's output is made a leaf, the others stay in
the graph above it, and one ``autograd.grad`` returns every block's gradient. It uses the summed
gradient (one backward), as ``gradient="summed"`` calibration does; at each block the numbers equal
a `collect_statistics` run at that block alone.

When the reference has the same blocks (a fine-tune of it), the scan also measures how far each
block's output moved from the reference's on the same text, and `best` skips blocks whose output
is the reference's own: a fine-tune that froze the lower blocks (partial fine-tuning, LoRA on
the top blocks) left them computing exactly what the reference computes, so they hold nothing
the fine-tune added. Measured on SmolLM2-135M with its top 8 of 30 blocks fine-tuned on canaries
(docs/your-model.md), the whitened strength peaked at the frozen block 2, where GSS left 93.8%
of the canaries memorized within +5% perplexity, against 0.0% at block 22, the lowest tuned one.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss.calibrate import TARGETS, _calibration_mode, _objective, _Tap, _tapped, same_model_error
from gss.data import TextsOrIds, batches, count_batches, encode
from gss.errors import GSSError, GSSWarning
from gss.hf.blocks import find_decoder_blocks, residual_width, resolve_layer
from gss.hf.forward import (
    check_same_vocab,
    check_sequences,
    forward_logits,
    target_mask,
    token_logprobs,
)
from gss.signal.replies import ReplySignal, warn_if_replies_alone
from gss.signal.tokens import encode_trained, reply_masks, trained_targets
from gss.solve.whitened import solve_probe_steer
from gss.statistics.accumulators import CovarianceAccumulator, CrossMomentAccumulator

UNCHANGED_TOLERANCE = 1e-5  # relative difference below which a block's output is the reference's


def signal_strength(memorization: Tensor, sigma: Tensor) -> float:
    """Top singular value of the whitened memorization matrix. The value is all a scan needs,
    so the solver's warning that a flat spectrum leaves the direction poorly determined is
    silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GSSWarning)
        return float(solve_probe_steer(memorization, sigma, 1, 1.0).singular_values[0])


@dataclass(frozen=True)
class LayerScan:
    """Signal strength per block (0-based), with what it was measured on.

    `difference` is each block's relative output difference from the reference,
    ``||h_model - h_ref|| / ||h_ref||`` over the scanned tokens (empty when the reference's
    blocks do not match the model's).
    """

    strengths: dict[int, float]
    memorized_tokens: int
    general_tokens: int
    seconds: float
    difference: dict[int, float] = field(default_factory=dict)

    @property
    def unchanged(self) -> list[int]:
        """Blocks whose output equals the reference's (the fine-tune did not reach them)."""
        return [k for k, v in self.difference.items() if v < UNCHANGED_TOLERANCE]

    @property
    def best(self) -> int:
        """The block with the strongest signal among those the fine-tune changed (all blocks
        when none, or every one, is unchanged)."""
        skipped = set(self.unchanged)
        candidates = [k for k in self.strengths if k not in skipped] or list(self.strengths)
        return max(candidates, key=lambda k: self.strengths[k])

    @property
    def strongest(self) -> int:
        """The block with the strongest signal, changed or not."""
        return max(self.strengths, key=lambda k: self.strengths[k])

    def to_dict(self) -> dict[str, Any]:
        return {
            "strengths": {str(k): v for k, v in self.strengths.items()},
            "best": self.best,
            "strongest": self.strongest,
            "difference": {str(k): v for k, v in self.difference.items()},
            "unchanged": self.unchanged,
            "memorized_tokens": self.memorized_tokens,
            "general_tokens": self.general_tokens,
            "seconds": self.seconds,
        }

    def plot(self, path: str | Path, title: str = "memorization signal per layer") -> Path:
        from gss.report import _pyplot, save_figure

        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.2))
        layers = sorted(self.strengths)
        ax.plot(layers, [self.strengths[k] for k in layers], marker="o")
        frozen = self.unchanged
        if frozen and len(frozen) < len(layers):
            ax.plot(
                frozen,
                [self.strengths[k] for k in frozen],
                "o",
                color="lightgray",
                label="output equals the reference's",
            )
        ax.axvline(self.best, color="gray", linestyle=":", label=f"best: block {self.best}")
        ax.set_xlabel("decoder block (0-based)")
        ax.set_ylabel("top singular value of Sigma^-1/2 M")
        ax.set_title(title)
        ax.legend()
        return save_figure(fig, path)


def scan_layers(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    *,
    layers: Sequence[int] | None = None,
    tokenizer: Any | None = None,
    gen_texts: TextsOrIds | None = None,
    omega_threshold: float = 0.0,
    target: str = "loglik",
    batch_size: int = 8,
    max_length: int | None = None,
    block_path: str | None = None,
    replies_only: bool = False,
    progress: bool = True,
) -> LayerScan:
    """Signal strength at each block of `layers` (default: all), from one calibration pass.

    Tokens with omega > `omega_threshold` are memorized (among those trained on, read from
    labels and `replies_only` as `calibrate` reads them); Sigma_gen comes from the other tokens
    of `texts`, or from `gen_texts` when given (an extra forward without gradients). Each
    scanned block holds two d x d float64 matrices in host memory, 16 d^2 bytes (5.3 MB at
    d = 576, 268 MB at d = 4096: 8.6 GB for all 32 blocks of a 7B model); pass `layers` to scan
    fewer.
    """
    if target not in TARGETS:
        raise GSSError(f"target must be one of {TARGETS}, got {target!r}.")
    check_same_vocab(model, reference)
    n_blocks = len(find_decoder_blocks(model, block_path))
    wanted = range(n_blocks) if layers is None else layers
    resolved = sorted({resolve_layer(model, layer, block_path)[0] for layer in wanted})
    if not resolved:
        raise GSSError("no layer to scan: give at least one block index.")
    blocks = [resolve_layer(model, i, block_path)[1] for i in resolved]
    dim = residual_width(model)
    ref_blocks = _matching_blocks(reference, resolved, n_blocks, dim, block_path)
    moved = [0.0] * len(resolved)
    norm = [0.0] * len(resolved)
    tokens = omega_nonzero = 0
    seqs, trained = encode_trained(texts, tokenizer, max_length, replies_only=replies_only)
    check_sequences((model, reference), seqs, "the texts")
    replies = ReplySignal(reply_masks(texts, tokenizer, max_length) if trained is None else None)
    gen_seqs = encode(gen_texts, tokenizer, max_length) if gen_texts is not None else None
    if gen_seqs is not None:
        check_sequences((model, reference), gen_seqs, "gen_texts")
    sigmas = [CovarianceAccumulator(dim) for _ in blocks]
    moments = [CrossMomentAccumulator(dim) for _ in blocks]
    started = time.perf_counter()

    def bar(items: Any, desc: str, total: int) -> Any:
        return tqdm(items, desc=desc, total=total, disable=not progress, leave=False)

    with _calibration_mode(model, reference):
        for batch in bar(
            batches(seqs, batch_size), "gss: layer scan", count_batches(len(seqs), batch_size)
        ):
            with torch.no_grad(), ExitStack() as stack:
                ref_taps = [
                    stack.enter_context(_tapped(b, stop=False, leaf=False)) for b in ref_blocks
                ]
                ref_logits = forward_logits(reference, batch.input_ids, batch.attention_mask)
            with torch.enable_grad(), ExitStack() as stack:
                taps = [
                    stack.enter_context(_tapped(block, stop=False, leaf=i == 0))
                    for i, block in enumerate(blocks)
                ]
                logits = forward_logits(model, batch.input_ids, batch.attention_mask)
                lp = token_logprobs(logits, batch.input_ids)
                ref_logits = ref_logits.to(logits.device)
                omega = lp.detach() - token_logprobs(ref_logits, batch.input_ids)
                valid = target_mask(batch.attention_mask).to(lp.device)
                mem = trained_targets(trained, batch, valid) & (omega > omega_threshold)
                replies.update(batch, omega, valid)
                tokens += int(valid.sum())
                omega_nonzero += int((valid & (omega != 0)).sum())
                hiddens = _outputs(taps)
                for i, ref_hidden in enumerate(_outputs(ref_taps, " of the reference")):
                    ours = hiddens[i].detach()[:, :-1][valid.to(hiddens[i].device)]
                    theirs = ref_hidden[:, :-1][valid.to(ref_hidden.device)].to(ours.device)
                    moved[i] += float((ours - theirs).double().pow(2).sum())
                    norm[i] += float(theirs.double().pow(2).sum())
                if int(mem.sum()):
                    objective = _objective(target, logits, lp, ref_logits, mem)
                    grads = torch.autograd.grad(objective, hiddens)
                    for moment, h, g in zip(moments, hiddens, grads, strict=True):
                        m = mem.to(h.device)
                        moment.update(h[:, :-1][m], g[:, :-1][m])
                if gen_seqs is None:
                    for sigma, h in zip(sigmas, hiddens, strict=True):
                        sigma.update(h.detach()[:, :-1][(valid & ~mem).to(h.device)])
        if gen_seqs is not None:
            for batch in bar(
                batches(gen_seqs, batch_size),
                "gss: Sigma_gen",
                count_batches(len(gen_seqs), batch_size),
            ):
                with torch.no_grad(), ExitStack() as stack:
                    taps = [stack.enter_context(_tapped(b, stop=False, leaf=False)) for b in blocks]
                    forward_logits(model, batch.input_ids, batch.attention_mask)
                valid = target_mask(batch.attention_mask)
                for sigma, h in zip(sigmas, _outputs(taps), strict=True):
                    sigma.update(h[:, :-1][valid.to(h.device)])
    if moments[0].count == 0 and omega_nonzero == 0:
        raise same_model_error(tokens)
    warn_if_replies_alone(replies.result())
    strengths = {
        layer: signal_strength(m.value, s.covariance)
        for layer, m, s in zip(resolved, moments, sigmas, strict=True)
    }
    pairs = zip(resolved, moved, norm, strict=True)
    difference = {layer: (m / max(n, 1e-30)) ** 0.5 for layer, m, n in pairs} if ref_blocks else {}
    return LayerScan(
        strengths=strengths,
        memorized_tokens=moments[0].count,
        general_tokens=sigmas[0].count,
        seconds=time.perf_counter() - started,
        difference=difference,
    )


def _outputs(taps: Sequence[_Tap], whose: str = "") -> list[Tensor]:
    """What each tapped block output; an error if one never ran."""
    hiddens = [tap.hidden for tap in taps if tap.hidden is not None]
    if len(hiddens) != len(taps):
        raise GSSError(f"a scanned block{whose} never ran: is it part of the forward pass?")
    return hiddens


def _matching_blocks(
    reference: nn.Module, layers: Sequence[int], n_blocks: int, dim: int, block_path: str | None
) -> list[nn.Module]:
    """The reference's blocks at `layers` when it has the model's block count and width (a
    fine-tune of it); otherwise none, and the scan compares nothing."""
    try:
        ref_blocks = find_decoder_blocks(reference, block_path)
    except GSSError:
        return []
    if len(ref_blocks) != n_blocks or residual_width(reference) != dim:
        return []
    return [ref_blocks[i] for i in layers]
