"""The calibration pass: omega, the token split, Sigma_gen and M at one decoder block.

One pass over the calibration text runs the reference forward, the model forward with block
L's output tapped, and a backward from the objective of the memorized tokens down to that tap
only (the model's weights are frozen, so no weight gradients are computed and nothing below
block L is differentiated). Statistics stream; activations are never kept, except the
general tokens' hidden states while they are few enough to spare the thresholds a second pass.

Gradient sign: g is the gradient of the *log-likelihood* (``-grad CE``) of the memorized
tokens, so the update ``h - s v`` lowers their likelihood (METHOD-NOTES 2.1). With
``gradient="summed"`` one backward of the summed objective gives each position the gradient
of all later memorized tokens' objectives too (METHOD-NOTES 2.5); at the last block that is
exact, at earlier blocks an approximation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss import distributed
from gss.config import DEFAULT_PRESET, CalibrationConfig, RunOptions, resolve
from gss.data import Batch, TextsOrIds, batches, count_batches, encode_compact
from gss.errors import GSSError
from gss.hf.blocks import find_decoder_blocks, residual_width, resolve_layer
from gss.hf.forward import (
    check_models,
    check_same_vocab,
    check_sequences,
    execution_device,
    forward_logits,
    target_mask,
    token_logprobs,
)
from gss.hf.quantization import check_backward
from gss.signal.omega import nonfinite_error
from gss.signal.replies import ReplySignal, warn_if_replies_alone
from gss.signal.tokens import encode_trained, reply_masks, trained_targets
from gss.statistics.accumulators import (
    CovarianceAccumulator,
    CrossMomentAccumulator,
    MeanAccumulator,
)
from gss.statistics.capture import Tap, block_outputs, calibration_mode, outputs, tapped
from gss.statistics.gradients import per_position_gradients
from gss.steering.attach import warn_if_steered

# What the pass fixes: a statistics object can make artifacts that differ in anything else.
COLLECT_FIELDS = (
    "layer",
    "block_path",
    "omega_threshold",
    "memorized_quantile",
    "replies_only",
    "target",
    "gradient",
    "max_length",
)


class _GeneralKeeper:
    """Collects general-token hidden states on the host until more than ``cap`` were seen."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: list[Tensor] | None = []
        self.count = 0

    def add(self, rows: Tensor) -> None:
        self.count += rows.shape[0]
        if self.parts is None:
            return
        if self.count > self.cap:
            self.parts = None  # too many: the thresholds will take a second pass
        else:
            self.parts.append(rows.detach().float().cpu())

    def result(self) -> list[Tensor] | None:
        """The kept batches as they came: concatenating them would double the peak memory."""
        if self.parts is None or not self.parts:
            return None
        return self.parts


class GeneralFlags:
    """Which next-token targets were general, for every batch, in one buffer allocated up front.

    The threshold pass needs each batch's general-token mask again. Kept as one small tensor
    per batch, those long-lived allocations sat between the pass's large transient ones and
    pinned glibc's heap: the process grew with the corpus (+15 MB over 1,600 texts of 32
    tokens) from fragmentation alone. One bool per target, allocated once, does not.
    """

    def __init__(self, seqs: Sequence[Tensor]) -> None:
        self.flags = torch.zeros(sum(len(s) - 1 for s in seqs), dtype=torch.bool)
        self.spans: list[tuple[int, int]] = []

    def add(self, general: Tensor, valid: Tensor) -> None:
        """Record one batch, in batch order: ``general`` and ``valid`` are (B, T-1) masks."""
        start = self.spans[-1][1] if self.spans else 0
        end = start + int(valid.sum())
        self.flags[start:end] = general[valid].cpu()
        self.spans.append((start, end))

    def mask(self, index: int, valid: Tensor) -> Tensor:
        """The (B, T-1) general-token mask of batch ``index``, on the CPU."""
        start, end = self.spans[index]
        out = torch.zeros(valid.shape, dtype=torch.bool)
        out[valid.cpu()] = self.flags[start:end]
        return out


def objective(
    target: str,
    logits: Tensor,
    lp_model: Tensor,
    ref_logits: Tensor | None,
    mem: Tensor,
    vocab: int | None = None,
) -> Tensor:
    """Sum over memorized targets of the quantity whose gradient defines g (distributions over
    the first ``vocab`` logits, those both models share)."""
    if target == "loglik":
        per_token = lp_model
    else:  # toward-reference: log p(x_t) - sum_y p_ref(y) log p(y); logits grad e_x - p_ref
        assert ref_logits is not None
        logp = torch.log_softmax(logits[:, :-1, :vocab].float(), dim=-1)
        p_ref = torch.softmax(ref_logits[:, :-1, :vocab].float(), dim=-1)
        per_token = lp_model - (p_ref * logp).sum(-1)
    return (per_token * mem).sum()


@dataclass
class CalibrationStatistics:
    """What one calibration pass gathered at one layer: enough to solve for any rank, delta
    and centering, to set thresholds, and to build mean-difference steering."""

    config: CalibrationConfig  # what the pass was asked, with the layer resolved to an index
    sigma: CovarianceAccumulator
    memorization: CrossMomentAccumulator
    memorized_mean: MeanAccumulator
    counts: dict[str, Any]
    timings: dict[str, float]
    memorized_rule: dict[str, Any]
    batch_size: int
    seqs: list[Tensor]  # token ids, compact (`encode_compact`)
    gen_seqs: list[Tensor] | None
    general_flags: GeneralFlags | None = None  # set when Sigma_gen comes from `seqs` itself
    # every general token's hidden state (float32, CPU) while they fit in `keep_general`, so
    # that the thresholds need no second pass; None once more were seen
    general_sample: list[Tensor] | None = None

    @property
    def layer(self) -> int:
        assert self.config.layer is not None  # resolved by the pass
        return self.config.layer

    @property
    def block_path(self) -> str | None:
        return self.config.block_path

    def general_batches(self) -> Iterator[tuple[Batch, Tensor]]:
        """The general tokens, batch by batch, in the order the statistics saw them."""
        if self.gen_seqs is None:
            for b, batch in enumerate(batches(self.seqs, self.batch_size)):
                assert self.general_flags is not None
                yield batch, self.general_flags.mask(b, target_mask(batch.attention_mask))
        else:
            for batch in batches(self.gen_seqs, self.batch_size):
                yield batch, target_mask(batch.attention_mask)

    @property
    def general_batch_count(self) -> int:
        return count_batches(len(self.gen_seqs or self.seqs), self.batch_size)


def collect_statistics(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    config: CalibrationConfig | str = DEFAULT_PRESET,
    *,
    tokenizer: Any = None,
    gen_texts: TextsOrIds | None = None,
    **overrides: Any,
) -> CalibrationStatistics:
    """The calibration pass: omega, the token split, Sigma_gen and M at block ``config.layer``.

    ``config`` and ``overrides`` as in `gss.calibrate`; the pass reads only the fields in
    `COLLECT_FIELDS`, and `build_artifact` takes the rest. Only tokens the fine-tune was
    trained on can be memorized (`gss.signal.tokens`): those whose ``labels`` are not -100 in
    rows that have labels, the replies with ``replies_only``.

    While the general tokens number at most ``keep_general`` (default: as many as fit in
    64 MB of float32 hidden states), their hidden states are kept so that `build_artifact` sets
    the gate thresholds without running the model again; beyond that it runs a second pass.
    """
    cfg, run = resolve(config, overrides)
    return collect(model, reference, texts, cfg, run, tokenizer, gen_texts)


def collect(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    cfg: CalibrationConfig,
    run: RunOptions,
    tokenizer: Any | None,
    gen_texts: TextsOrIds | None,
) -> CalibrationStatistics:
    """The pass at ``cfg.layer`` alone, as `CalibrationStatistics`."""
    if cfg.layer is None:
        raise GSSError(
            "no layer given: pass layer=N (a decoder block; gss.scan_layers(...).best picks one)."
        )
    check_models(model, reference)
    warn_if_steered(resolve_layer(model, cfg.layer, cfg.block_path)[1], "calibrating here")
    dim = residual_width(model)
    if cfg.rank > dim:  # known now: refused before the pass, not after it
        raise GSSError(
            f"rank must be an integer in 1..{dim} (the model's hidden size), got {cfg.rank}: "
            "ask for fewer directions."
        )
    done = run_pass(model, reference, texts, cfg, run, tokenizer, gen_texts, [cfg.layer])
    return CalibrationStatistics(
        config=cfg.replace(layer=done.layers[0]),
        sigma=done.sigma[0],
        memorization=done.memorization[0],
        memorized_mean=done.memorized_mean[0],
        counts=done.counts,
        timings=done.timings,
        memorized_rule=done.memorized_rule,
        batch_size=run.batch_size,
        seqs=done.seqs,
        gen_seqs=done.gen_seqs,
        general_flags=done.general_flags,
        general_sample=done.general_sample,
    )


@dataclass
class Pass:
    """What one pass gathered at each of its blocks (sorted by index), and on the way."""

    layers: list[int]
    sigma: list[CovarianceAccumulator]
    memorization: list[CrossMomentAccumulator]
    memorized_mean: list[MeanAccumulator]
    counts: dict[str, Any]
    timings: dict[str, float]
    memorized_rule: dict[str, Any]
    seqs: list[Tensor]
    gen_seqs: list[Tensor] | None
    general_flags: GeneralFlags | None
    general_sample: list[Tensor] | None
    # per block, ||h_model - h_ref||^2 and ||h_ref||^2 summed over the scanned tokens (with
    # compare_reference, when the reference has the model's blocks)
    moved: list[float] | None = None
    norm: list[float] | None = None


# gradients are part of the statistics: a caller's no_grad or inference_mode must not reach them
@torch.inference_mode(False)
@torch.enable_grad()
def run_pass(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    cfg: CalibrationConfig,
    run: RunOptions,
    tokenizer: Any | None,
    gen_texts: TextsOrIds | None,
    layers: Sequence[int],
    compare_reference: bool = False,
    stacklevel: int = 5,
) -> Pass:
    """One pass over the text that gathers Sigma_gen and M at every block of ``layers`` from
    the same forward and backward passes: calibration's at one block, the layer scan's at
    many. With one block it also keeps what the thresholds need (which tokens were general,
    and their hidden states while few); ``compare_reference`` measures how far each block's
    output moved from the reference's."""
    inputs = _read_inputs(model, reference, texts, cfg, tokenizer, gen_texts, layers)
    sums = _start_sums(model, reference, inputs, cfg, run, compare_reference)
    with calibration_mode(model, reference):
        cut, ref_logp = _omega_cut(model, reference, inputs, cfg, run, sums)
        desc = "gss: signal + statistics" if inputs.single else "gss: layer scan"
        n_batches = count_batches(len(inputs.seqs), run.batch_size)
        for b, batch in enumerate(
            _bar(batches(inputs.seqs, run.batch_size), desc, n_batches, run.progress)
        ):
            _one_batch(model, reference, batch, ref_logp.get(b), cut, inputs, cfg, sums)
        if inputs.gen_seqs is not None:
            _general_pass(model, inputs.gen_seqs, inputs, run, sums)

    for accs in (sums.sigma, sums.memorization, sums.memorized_mean):
        for acc in accs:
            acc.all_reduce()
    counts = sums.counts
    keys = ("sequences", "tokens", "trained", "memorized", "general", "omega_nonzero")
    distributed.sum_counts(counts, keys)
    counts["memorized_share"] = counts["memorized"] / max(counts["tokens"], 1)
    reply_signal = inputs.replies.result()
    if reply_signal is not None:
        counts["replies"] = reply_signal
        warn_if_replies_alone(reply_signal, stacklevel=stacklevel)
    return _assembled(inputs, cfg, sums, cut)


@dataclass
class _Inputs:
    """What `run_pass` reads, checked and encoded before any forward: bad input is refused
    before the expensive work, and the steps after it share one record of it."""

    vocab: int | None  # the logits both models share (`check_same_vocab`)
    layers: list[int]  # the blocks' indices, sorted
    blocks: list[nn.Module]
    summed: bool  # gradient="summed": one backward of the summed objective
    seqs: list[Tensor]  # this process's share of the texts' token ids
    trained: list[Tensor] | None  # which of their tokens were trained on (None: all)
    replies: ReplySignal
    gen_seqs: list[Tensor] | None

    @property
    def single(self) -> bool:
        """One block: the pass also keeps what calibration's thresholds need."""
        return len(self.blocks) == 1


def _read_inputs(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    cfg: CalibrationConfig,
    tokenizer: Any | None,
    gen_texts: TextsOrIds | None,
    layers: Sequence[int],
) -> _Inputs:
    """The blocks and the token ids of the pass, each checked in the order the pass always
    checked them (the vocabularies, the blocks, the texts, then gen_texts)."""
    block_path, max_length = cfg.block_path, cfg.max_length
    vocab = check_same_vocab(model, reference, tokenizer)
    resolved = sorted({resolve_layer(model, layer, block_path)[0] for layer in layers})
    if not resolved:
        raise GSSError("no layer to read: give at least one block index.")
    blocks = [resolve_layer(model, i, block_path)[1] for i in resolved]
    # a quantized model whose layers above the lowest tap drop the gradient: refused now
    check_backward(model, find_decoder_blocks(model, block_path)[: resolved[0] + 1])
    summed = cfg.gradient == "summed"
    if not summed and len(blocks) != 1:
        raise GSSError(
            "gradient='per-position' reads one block at a time: scan with 'summed', or "
            "calibrate each block apart."
        )
    head: list[Any] = []  # the first rows, for the replies check: a stream is read once
    all_seqs, all_trained = encode_trained(
        texts, tokenizer, max_length, replies_only=cfg.replies_only, head=head
    )
    check_sequences((model, reference), all_seqs, "the texts")
    seqs = distributed.shard(all_seqs)
    trained = distributed.shard(all_trained) if all_trained is not None else None
    # nothing restricts the memorized set: does the signal say the replies alone were trained?
    masks = reply_masks(head, tokenizer, max_length) if all_trained is None else None
    replies = ReplySignal(distributed.shard(masks) if masks is not None else None)
    gen_seqs = None
    if gen_texts is not None:
        all_gen = encode_compact(gen_texts, tokenizer, max_length)
        check_sequences((model, reference), all_gen, "gen_texts")
        gen_seqs = distributed.shard(all_gen)
    return _Inputs(vocab, resolved, blocks, summed, seqs, trained, replies, gen_seqs)


@dataclass
class _Sums:
    """What `run_pass` adds up over its batches: the statistics at each block, the general
    tokens kept for the thresholds, the distance to the reference, the counts and the time
    each part took."""

    sigma: list[CovarianceAccumulator]
    memorization: list[CrossMomentAccumulator]
    memorized_mean: list[MeanAccumulator]
    keeper: _GeneralKeeper
    general_flags: GeneralFlags | None
    ref_blocks: list[nn.Module]  # the reference's blocks to compare with (none: no comparing)
    moved: list[float]
    norm: list[float]
    counts: dict[str, Any]
    timings: dict[str, float]


def _start_sums(
    model: nn.Module,
    reference: nn.Module,
    inputs: _Inputs,
    cfg: CalibrationConfig,
    run: RunOptions,
    compare_reference: bool,
) -> _Sums:
    """Empty sums, on each block's device, before the first batch."""
    dim = residual_width(model)
    devices = [execution_device(model, block) for block in inputs.blocks]
    keep_general = run.keep_general
    keeper = _GeneralKeeper(keep_general if keep_general is not None else 2**24 // dim)
    sigma_accs = [CovarianceAccumulator(dim, device) for device in devices]
    m_accs = [CrossMomentAccumulator(dim, device) for device in devices]
    mem_means = [MeanAccumulator(dim, device) for device in devices]
    ref_blocks = (
        _matching_blocks(reference, inputs.layers, model, cfg.block_path)
        if compare_reference
        else []
    )
    moved = [0.0] * len(inputs.blocks)
    norm = [0.0] * len(inputs.blocks)
    timings = {"signal": 0.0, "statistics": 0.0}
    counts: dict[str, Any] = {
        "sequences": len(inputs.seqs),
        "tokens": 0,
        "memorized": 0,
        "general": 0,
    }
    counts["trained"] = 0  # the tokens that could be memorized (all, without labels or replies)
    # tokens whose log-prob differs between the two models: none means the reference is the
    # model itself, which the callers say in so many words
    counts["omega_nonzero"] = 0
    general_flags = GeneralFlags(inputs.seqs) if inputs.gen_seqs is None and inputs.single else None
    return _Sums(
        sigma_accs,
        m_accs,
        mem_means,
        keeper,
        general_flags,
        ref_blocks,
        moved,
        norm,
        counts,
        timings,
    )


def _bar(it: Any, desc: str, total: int, progress: bool) -> Any:
    """A progress bar of the pass, gone when done."""
    return tqdm(it, desc=desc, total=total, disable=not progress, leave=False)


def _logprobs(m: nn.Module, batch: Batch, vocab: int | None) -> Tensor:
    """Each target's log-probability under ``m``, over the first ``vocab`` logits."""
    return token_logprobs(
        forward_logits(m, batch.input_ids, batch.attention_mask), batch.input_ids, vocab
    )


def _omega_cut(
    model: nn.Module,
    reference: nn.Module,
    inputs: _Inputs,
    cfg: CalibrationConfig,
    run: RunOptions,
    sums: _Sums,
) -> tuple[float, dict[int, Tensor]]:
    """The omega above which a token is memorized, and the reference's log-probabilities by
    batch where a pre-pass read them: ``omega_threshold``, or the global cut of the
    top-quantile rule (`memorized_quantile`), which needs every token's omega first."""
    ref_logp: dict[int, Tensor] = {}
    cut = cfg.omega_threshold
    if cfg.memorized_quantile is not None:
        seqs, batch_size = inputs.seqs, run.batch_size
        t0 = time.perf_counter()
        all_omega = []
        for b, batch in enumerate(
            _bar(
                batches(seqs, batch_size),
                "gss: omega (quantile rule)",
                count_batches(len(seqs), batch_size),
                run.progress,
            )
        ):
            with torch.no_grad():
                lp_ref = _logprobs(reference, batch, inputs.vocab)
                lp = _logprobs(model, batch, inputs.vocab)
            ref_logp[b] = lp_ref
            valid = trained_targets(
                inputs.trained, batch, target_mask(batch.attention_mask).to(lp.device)
            )
            all_omega.append((lp - lp_ref.to(lp.device))[valid].float().cpu())
        values = distributed.gather_rows(torch.cat(all_omega))[: 2**24].double()
        cut = float(torch.quantile(values, 1 - cfg.memorized_quantile))
        sums.timings["signal"] += time.perf_counter() - t0
    return cut, ref_logp


@dataclass
class _Forward:
    """One batch's forwards: the model's with its blocks tapped (gradients flow to the taps
    with the summed objective), and the reference's where its log-probabilities were not
    kept by the pre-pass or its blocks are compared."""

    logits: Tensor
    lp_model: Tensor
    lp_ref: Tensor
    ref_logits: Tensor | None
    taps: list[Tap]
    ref_taps: list[Tap]


def _forward(
    model: nn.Module,
    reference: nn.Module,
    batch: Batch,
    kept_lp_ref: Tensor | None,
    inputs: _Inputs,
    target: str,
    ref_blocks: list[nn.Module],
) -> _Forward:
    """Both models' forwards over ``batch`` (the reference's log-probabilities from the
    pre-pass, ``kept_lp_ref``, where they are all the objective needs)."""
    vocab = inputs.vocab
    ref_logits = None
    ref_taps: list[Tap] = []
    if kept_lp_ref is not None and target == "loglik" and not ref_blocks:
        lp_ref = kept_lp_ref
    else:
        with torch.no_grad(), ExitStack() as stack:
            ref_taps = [
                stack.enter_context(tapped(rb, stop=False, leaf=False)) for rb in ref_blocks
            ]
            ref_logits = forward_logits(reference, batch.input_ids, batch.attention_mask)
        lp_ref = token_logprobs(ref_logits, batch.input_ids, vocab)
    # gradients stop at the lowest block: the ones above it are read on the way
    summed = inputs.summed
    with torch.set_grad_enabled(summed), ExitStack() as stack:
        taps = [
            stack.enter_context(tapped(block, stop=False, leaf=summed and i == 0))
            for i, block in enumerate(inputs.blocks)
        ]
        logits = forward_logits(model, batch.input_ids, batch.attention_mask)
    lp_model = token_logprobs(logits, batch.input_ids, vocab)
    return _Forward(logits, lp_model, lp_ref, ref_logits, taps, ref_taps)


@dataclass
class _Split:
    """One batch's targets as the memorization signal splits them ((B, T-1) each)."""

    valid: Tensor  # real targets, not padding
    omega: Tensor  # log p_model - log p_ref
    eligible: Tensor  # the trained-on targets, the ones that can be memorized
    mem: Tensor  # memorized: eligible with omega above the cut
    gen: Tensor  # general: every other valid target


def _split(fwd: _Forward, batch: Batch, cut: float, inputs: _Inputs) -> _Split:
    """Omega and the token split of one batch; a non-finite log-probability is refused."""
    lp_model = fwd.lp_model
    valid = target_mask(batch.attention_mask).to(lp_model.device)
    omega = lp_model.detach() - fwd.lp_ref.to(lp_model.device)
    if not bool(torch.isfinite(omega[valid]).all()):
        bad = "model" if not bool(torch.isfinite(lp_model[valid]).all()) else "reference"
        raise nonfinite_error(bad, "calibration")
    eligible = trained_targets(inputs.trained, batch, valid)
    inputs.replies.update(batch, omega, valid)
    mem = eligible & (omega > cut)
    gen = valid & ~mem
    return _Split(valid, omega, eligible, mem, gen)


def _one_batch(
    model: nn.Module,
    reference: nn.Module,
    batch: Batch,
    kept_lp_ref: Tensor | None,
    cut: float,
    inputs: _Inputs,
    cfg: CalibrationConfig,
    sums: _Sums,
) -> None:
    """One batch of the pass: the signal (both forwards, the token split), then what each
    block's statistics take from it."""
    t0 = time.perf_counter()
    fwd = _forward(model, reference, batch, kept_lp_ref, inputs, cfg.target, sums.ref_blocks)
    split = _split(fwd, batch, cut, inputs)
    sums.timings["signal"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    _batch_statistics(model, batch, fwd, split, inputs, cfg.target, sums)
    del fwd
    sums.timings["statistics"] += time.perf_counter() - t0


def _batch_statistics(
    model: nn.Module,
    batch: Batch,
    fwd: _Forward,
    split: _Split,
    inputs: _Inputs,
    target: str,
    sums: _Sums,
) -> None:
    """Add one batch to the sums: the distance to the reference's blocks, M and the
    memorized mean from the memorized tokens' gradients, Sigma_gen from the general tokens
    (without gen_texts), and the counts."""
    valid, mem, gen = split.valid, split.mem, split.gen
    hiddens = outputs(fwd.taps)
    for i, ref_hidden in enumerate(
        outputs(fwd.ref_taps, " of the reference") if sums.ref_blocks else []
    ):
        ours = hiddens[i].detach()[:, :-1][valid.to(hiddens[i].device)]
        theirs = ref_hidden[:, :-1][valid.to(ref_hidden.device)].to(ours.device)
        sums.moved[i] += float((ours - theirs).double().pow(2).sum())
        sums.norm[i] += float(theirs.double().pow(2).sum())
    n_mem = int(mem.sum())
    if n_mem:
        pairs = _memorized_pairs(model, batch, fwd, mem, hiddens, inputs, target)
        for (h_mem, g_mem), m_acc, mem_mean in zip(
            pairs, sums.memorization, sums.memorized_mean, strict=True
        ):
            m_acc.update(h_mem, g_mem)
            mem_mean.update(h_mem.detach())
    if inputs.gen_seqs is None:
        for hidden, sigma_acc in zip(hiddens, sums.sigma, strict=True):
            gen_h = hidden.detach()[:, :-1][gen.to(hidden.device)]
            sigma_acc.update(gen_h)
            if inputs.single:
                sums.keeper.add(gen_h)
        if sums.general_flags is not None:
            sums.general_flags.add(gen, valid)
    counts = sums.counts
    counts["tokens"] += int(valid.sum())
    counts["trained"] += int(split.eligible.sum())
    counts["memorized"] += n_mem
    counts["general"] += int(gen.sum())
    counts["omega_nonzero"] += int((valid & (split.omega != 0)).sum())


def _memorized_pairs(
    model: nn.Module,
    batch: Batch,
    fwd: _Forward,
    mem: Tensor,
    hiddens: list[Tensor],
    inputs: _Inputs,
    target: str,
) -> list[tuple[Tensor, Tensor]]:
    """Per block, the memorized tokens' hidden states and the gradients g at them: from one
    backward of the summed objective, or (per-position) one per memorized token."""
    ref_logits = fwd.ref_logits
    if ref_logits is not None:
        ref_logits = ref_logits.to(fwd.logits.device)
    if inputs.summed:
        total = objective(target, fwd.logits, fwd.lp_model, ref_logits, mem, inputs.vocab)
        grads = torch.autograd.grad(total, hiddens)
        pairs = []
        for hidden, grad in zip(hiddens, grads, strict=True):
            mem_h = mem.to(hidden.device)
            pairs.append((hidden[:, :-1][mem_h], grad[:, :-1][mem_h]))
        return pairs
    rows, positions = mem.nonzero(as_tuple=True)
    return [
        per_position_gradients(
            model,
            inputs.blocks[0],
            batch.input_ids,
            batch.attention_mask,
            rows.cpu(),
            positions.cpu(),
            target,
            ref_logits,
            inputs.vocab,
        )
    ]


def _general_pass(
    model: nn.Module, gen_seqs: list[Tensor], inputs: _Inputs, run: RunOptions, sums: _Sums
) -> None:
    """Sigma_gen from gen_texts: a forward without gradients, stopped after the blocks."""
    t0 = time.perf_counter()
    for batch in _bar(
        batches(gen_seqs, run.batch_size),
        "gss: Sigma_gen",
        count_batches(len(gen_seqs), run.batch_size),
        run.progress,
    ):
        mask = target_mask(batch.attention_mask)
        for hidden, sigma_acc in zip(
            block_outputs(model, inputs.blocks, batch), sums.sigma, strict=True
        ):
            gen_h = hidden[:, :-1][mask.to(hidden.device)]
            sigma_acc.update(gen_h)
            if inputs.single:
                sums.keeper.add(gen_h)
        sums.counts["general"] += int(mask.sum())
    sums.timings["statistics"] += time.perf_counter() - t0


def _assembled(inputs: _Inputs, cfg: CalibrationConfig, sums: _Sums, cut: float) -> Pass:
    """The `Pass` of the reduced sums, with the memorized-token rule it applied."""
    memorized_quantile = cfg.memorized_quantile
    memorized_rule = {
        "kind": "quantile" if memorized_quantile is not None else "omega_above",
        "omega_threshold": cfg.omega_threshold if memorized_quantile is None else None,
        "quantile": memorized_quantile,
        "cut": cut,
        "sigma_from": "gen_texts" if inputs.gen_seqs is not None else "non_memorized_tokens",
        "among": "trained tokens" if inputs.trained is not None else "all tokens",
    }
    compared = bool(sums.ref_blocks)
    return Pass(
        layers=inputs.layers,
        sigma=sums.sigma,
        memorization=sums.memorization,
        memorized_mean=sums.memorized_mean,
        counts=sums.counts,
        timings=sums.timings,
        memorized_rule=memorized_rule,
        seqs=inputs.seqs,
        gen_seqs=inputs.gen_seqs,
        general_flags=sums.general_flags,
        general_sample=sums.keeper.result() if inputs.single else None,
        moved=sums.moved if compared else None,
        norm=sums.norm if compared else None,
    )


def _matching_blocks(
    reference: nn.Module, layers: Sequence[int], model: nn.Module, block_path: str | None
) -> list[nn.Module]:
    """The reference's blocks at `layers` when it has the model's block count and width (a
    fine-tune of it); otherwise none, and nothing is compared."""
    try:
        ref_blocks = find_decoder_blocks(reference, block_path)
    except GSSError:
        return []
    n_blocks = len(find_decoder_blocks(model, block_path))
    if len(ref_blocks) != n_blocks or residual_width(reference) != residual_width(model):
        return []
    return [ref_blocks[i] for i in layers]


def same_model_error(tokens: int, what: str = "calibration") -> GSSError:
    """What to say when omega is 0 on every token: the reference is the model itself."""
    return GSSError(
        f"the model and the reference give each of the {tokens} {what} tokens the same "
        "log-probability (omega = 0 everywhere), so no token can be told memorized: the "
        "reference is the fine-tuned model itself or has its weights. Pass the model the "
        "fine-tune started from (for a LoRA: gss.adapters_off(model), or --reference "
        "adapters-off)."
    )
