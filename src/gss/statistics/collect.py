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
    block_path, max_length = cfg.block_path, cfg.max_length
    omega_threshold, memorized_quantile = cfg.omega_threshold, cfg.memorized_quantile
    target, gradient, replies_only = cfg.target, cfg.gradient, cfg.replies_only
    batch_size, keep_general, progress = run.batch_size, run.keep_general, run.progress
    vocab = check_same_vocab(model, reference, tokenizer)
    resolved = sorted({resolve_layer(model, layer, block_path)[0] for layer in layers})
    if not resolved:
        raise GSSError("no layer to read: give at least one block index.")
    blocks = [resolve_layer(model, i, block_path)[1] for i in resolved]
    # a quantized model whose layers above the lowest tap drop the gradient: refused now
    check_backward(model, find_decoder_blocks(model, block_path)[: resolved[0] + 1])
    single = len(blocks) == 1
    summed = gradient == "summed"
    if not summed and not single:
        raise GSSError(
            "gradient='per-position' reads one block at a time: scan with 'summed', or "
            "calibrate each block apart."
        )
    head: list[Any] = []  # the first rows, for the replies check: a stream is read once
    all_seqs, all_trained = encode_trained(
        texts, tokenizer, max_length, replies_only=replies_only, head=head
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
    dim = residual_width(model)
    devices = [execution_device(model, block) for block in blocks]
    keeper = _GeneralKeeper(keep_general if keep_general is not None else 2**24 // dim)
    sigma_accs = [CovarianceAccumulator(dim, device) for device in devices]
    m_accs = [CrossMomentAccumulator(dim, device) for device in devices]
    mem_means = [MeanAccumulator(dim, device) for device in devices]
    ref_blocks = (
        _matching_blocks(reference, resolved, model, block_path) if compare_reference else []
    )
    moved = [0.0] * len(blocks)
    norm = [0.0] * len(blocks)
    timings = {"signal": 0.0, "statistics": 0.0}
    counts: dict[str, Any] = {"sequences": len(seqs), "tokens": 0, "memorized": 0, "general": 0}
    counts["trained"] = 0  # the tokens that could be memorized (all, without labels or replies)
    # tokens whose log-prob differs between the two models: none means the reference is the
    # model itself, which the callers say in so many words
    counts["omega_nonzero"] = 0
    n_batches = count_batches(len(seqs), batch_size)
    general_flags = GeneralFlags(seqs) if gen_seqs is None and single else None

    def bar(it: Any, desc: str, total: int) -> Any:
        return tqdm(it, desc=desc, total=total, disable=not progress, leave=False)

    def logprobs(m: nn.Module, batch: Batch) -> Tensor:
        return token_logprobs(
            forward_logits(m, batch.input_ids, batch.attention_mask), batch.input_ids, vocab
        )

    with calibration_mode(model, reference):
        # Optional pre-pass: the global omega cut of the top-quantile rule.
        ref_logp: dict[int, Tensor] = {}
        cut = omega_threshold
        if memorized_quantile is not None:
            t0 = time.perf_counter()
            all_omega = []
            for b, batch in enumerate(
                bar(batches(seqs, batch_size), "gss: omega (quantile rule)", n_batches)
            ):
                with torch.no_grad():
                    lp_ref = logprobs(reference, batch)
                    lp = logprobs(model, batch)
                ref_logp[b] = lp_ref
                valid = trained_targets(
                    trained, batch, target_mask(batch.attention_mask).to(lp.device)
                )
                all_omega.append((lp - lp_ref.to(lp.device))[valid].float().cpu())
            values = distributed.gather_rows(torch.cat(all_omega))[: 2**24].double()
            cut = float(torch.quantile(values, 1 - memorized_quantile))
            timings["signal"] += time.perf_counter() - t0

        desc = "gss: signal + statistics" if single else "gss: layer scan"
        for b, batch in enumerate(bar(batches(seqs, batch_size), desc, n_batches)):
            t0 = time.perf_counter()
            ref_logits = None
            ref_taps: list[Tap] = []
            if b in ref_logp and target == "loglik" and not ref_blocks:
                lp_ref = ref_logp[b]
            else:
                with torch.no_grad(), ExitStack() as stack:
                    ref_taps = [
                        stack.enter_context(tapped(rb, stop=False, leaf=False)) for rb in ref_blocks
                    ]
                    ref_logits = forward_logits(reference, batch.input_ids, batch.attention_mask)
                lp_ref = token_logprobs(ref_logits, batch.input_ids, vocab)
            # gradients stop at the lowest block: the ones above it are read on the way
            with torch.set_grad_enabled(summed), ExitStack() as stack:
                taps = [
                    stack.enter_context(tapped(block, stop=False, leaf=summed and i == 0))
                    for i, block in enumerate(blocks)
                ]
                logits = forward_logits(model, batch.input_ids, batch.attention_mask)
            lp_model = token_logprobs(logits, batch.input_ids, vocab)
            valid = target_mask(batch.attention_mask).to(lp_model.device)
            omega = lp_model.detach() - lp_ref.to(lp_model.device)
            if not bool(torch.isfinite(omega[valid]).all()):
                bad = "model" if not bool(torch.isfinite(lp_model[valid]).all()) else "reference"
                raise nonfinite_error(bad, "calibration")
            eligible = trained_targets(trained, batch, valid)
            replies.update(batch, omega, valid)
            mem = eligible & (omega > cut)
            gen = valid & ~mem
            timings["signal"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            hiddens = outputs(taps)
            for i, ref_hidden in enumerate(
                outputs(ref_taps, " of the reference") if ref_blocks else []
            ):
                ours = hiddens[i].detach()[:, :-1][valid.to(hiddens[i].device)]
                theirs = ref_hidden[:, :-1][valid.to(ref_hidden.device)].to(ours.device)
                moved[i] += float((ours - theirs).double().pow(2).sum())
                norm[i] += float(theirs.double().pow(2).sum())
            n_mem = int(mem.sum())
            if n_mem:
                if ref_logits is not None:
                    ref_logits = ref_logits.to(logits.device)
                if summed:
                    total = objective(target, logits, lp_model, ref_logits, mem, vocab)
                    grads = torch.autograd.grad(total, hiddens)
                    pairs = []
                    for hidden, grad in zip(hiddens, grads, strict=True):
                        mem_h = mem.to(hidden.device)
                        pairs.append((hidden[:, :-1][mem_h], grad[:, :-1][mem_h]))
                else:
                    rows, positions = mem.nonzero(as_tuple=True)
                    pairs = [
                        per_position_gradients(
                            model,
                            blocks[0],
                            batch.input_ids,
                            batch.attention_mask,
                            rows.cpu(),
                            positions.cpu(),
                            target,
                            ref_logits,
                            vocab,
                        )
                    ]
                for (h_mem, g_mem), m_acc, mem_mean in zip(pairs, m_accs, mem_means, strict=True):
                    m_acc.update(h_mem, g_mem)
                    mem_mean.update(h_mem.detach())
            if gen_seqs is None:
                for hidden, sigma_acc in zip(hiddens, sigma_accs, strict=True):
                    gen_h = hidden.detach()[:, :-1][gen.to(hidden.device)]
                    sigma_acc.update(gen_h)
                    if single:
                        keeper.add(gen_h)
                if general_flags is not None:
                    general_flags.add(gen, valid)
            counts["tokens"] += int(valid.sum())
            counts["trained"] += int(eligible.sum())
            counts["memorized"] += n_mem
            counts["general"] += int(gen.sum())
            counts["omega_nonzero"] += int((valid & (omega != 0)).sum())
            del logits, lp_model, hiddens, taps
            timings["statistics"] += time.perf_counter() - t0

        if gen_seqs is not None:
            t0 = time.perf_counter()
            for batch in bar(
                batches(gen_seqs, batch_size),
                "gss: Sigma_gen",
                count_batches(len(gen_seqs), batch_size),
            ):
                mask = target_mask(batch.attention_mask)
                for hidden, sigma_acc in zip(
                    block_outputs(model, blocks, batch), sigma_accs, strict=True
                ):
                    gen_h = hidden[:, :-1][mask.to(hidden.device)]
                    sigma_acc.update(gen_h)
                    if single:
                        keeper.add(gen_h)
                counts["general"] += int(mask.sum())
            timings["statistics"] += time.perf_counter() - t0

    for accs in (sigma_accs, m_accs, mem_means):
        for acc in accs:
            acc.all_reduce()
    keys = ("sequences", "tokens", "trained", "memorized", "general", "omega_nonzero")
    distributed.sum_counts(counts, keys)
    counts["memorized_share"] = counts["memorized"] / max(counts["tokens"], 1)
    reply_signal = replies.result()
    if reply_signal is not None:
        counts["replies"] = reply_signal
        warn_if_replies_alone(reply_signal, stacklevel=stacklevel)
    memorized_rule = {
        "kind": "quantile" if memorized_quantile is not None else "omega_above",
        "omega_threshold": omega_threshold if memorized_quantile is None else None,
        "quantile": memorized_quantile,
        "cut": cut,
        "sigma_from": "gen_texts" if gen_seqs is not None else "non_memorized_tokens",
        "among": "trained tokens" if trained is not None else "all tokens",
    }
    return Pass(
        layers=resolved,
        sigma=sigma_accs,
        memorization=m_accs,
        memorized_mean=mem_means,
        counts=counts,
        timings=timings,
        memorized_rule=memorized_rule,
        seqs=seqs,
        gen_seqs=gen_seqs,
        general_flags=general_flags,
        general_sample=keeper.result() if single else None,
        moved=moved if ref_blocks else None,
        norm=norm if ref_blocks else None,
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
