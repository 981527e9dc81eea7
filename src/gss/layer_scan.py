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
(results/canaries/), the whitened strength peaked at the frozen block 2, where GSS left 93.8%
of the canaries memorized within +5% perplexity, against 0.0% at block 22, the lowest tuned one.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from gss.config import DEFAULT_PRESET, CalibrationConfig, RunOptions, resolve
from gss.data import TextsOrIds
from gss.errors import GSSError, GSSWarning
from gss.hf.blocks import find_decoder_blocks, residual_width
from gss.solve.whitened import solve_probe_steer
from gss.statistics.collect import run_pass, same_model_error

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
        from gss.report import pyplot, save_figure

        plt = pyplot()
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
    config: CalibrationConfig | str = DEFAULT_PRESET,
    *,
    layers: Sequence[int] | None = None,
    tokenizer: Any = None,
    gen_texts: TextsOrIds | None = None,
    run: RunOptions | None = None,
    **overrides: Any,
) -> LayerScan:
    """Signal strength at each block of `layers` (default: all), from one calibration pass.

    Tokens with omega > `omega_threshold` are memorized (among those trained on, read from
    labels and `replies_only` as `calibrate` reads them); Sigma_gen comes from the other tokens
    of `texts`, or from `gen_texts` when given (an extra forward without gradients). Each
    scanned block holds two d x d float64 matrices in host memory, 16 d^2 bytes (5.3 MB at
    d = 576, 268 MB at d = 4096: 8.6 GB for all 32 blocks of a 7B model); pass `layers` to scan
    fewer.

    ``config``, ``run`` and ``overrides`` as in `gss.calibrate`: the scan reads the
    memorized-token rule (``omega_threshold``, ``replies_only``), ``target``, ``max_length``,
    ``block_path`` and the run options ``batch_size`` and ``progress``; ``layer`` and the
    solve's options play no part.
    """
    cfg, options = resolve(config, overrides, run)
    if layers is not None and (isinstance(layers, str) or not isinstance(layers, Iterable)):
        raise GSSError(f"layers is a list of block indices (e.g. [0, 2]), got {layers!r}.")
    started = time.perf_counter()
    wanted = range(len(find_decoder_blocks(model, cfg.block_path))) if layers is None else layers
    # run_pass refuses gradient="per-position" for several blocks rather than change it
    done = run_pass(
        model, reference, texts, cfg, options, tokenizer, gen_texts, list(wanted), True, 4
    )
    if done.memorization[0].count == 0 and done.counts["omega_nonzero"] == 0:
        raise same_model_error(done.counts["tokens"])
    strengths = {
        layer: signal_strength(m.value, s.covariance)
        for layer, m, s in zip(done.layers, done.memorization, done.sigma, strict=True)
    }
    general, dim = done.sigma[0].count, residual_width(model)
    if general < dim:  # as calibrate says it (gss.statistics.soundness): the jitter sets the scale
        warnings.warn(
            f"scan_layers: Sigma_gen rests on {general} general tokens for {dim} dimensions, so "
            "its regularisation, not the data, sets the strengths (orders of magnitude too "
            "large, and the blocks compare unreliably): give at least "
            f"{dim} general tokens (gen_texts / --gen-data; ten times that is better).",
            GSSWarning,
            stacklevel=2,
        )
    difference = {}
    if done.moved is not None and done.norm is not None:
        pairs = zip(done.layers, done.moved, done.norm, strict=True)
        difference = {layer: (m / max(n, 1e-30)) ** 0.5 for layer, m, n in pairs}
    return LayerScan(
        strengths=strengths,
        memorized_tokens=done.memorization[0].count,
        general_tokens=done.sigma[0].count,
        seconds=time.perf_counter() - started,
        difference=difference,
    )
