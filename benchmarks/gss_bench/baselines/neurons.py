"""TinyMem's neuron-level localization baselines (adapted there from Chang et al. 2024, MemPi).

Each method scores every MLP neuron of every block on the unlearn set U (``data.memorized``),
then, block by block, ablates the ``k = max(1, floor(width * ratio))`` highest-scoring neurons of
an edited copy with :func:`gss_bench.baselines.mlp.zero_neurons`. Only MLP parameters change.

- ``zero-out``: the loss increase on U when that single neuron is zeroed (its default grid
  scores exactly only the candidates of a first-order estimate: see ``reduced_grid``);
- ``act``: mean |activation| on U times the norm of the neuron's output weights;
- ``ig``: integrated gradients of the true next token's probability w.r.t. the activation (its
  default grid scores a fixed sample of positions: see ``reduced_grid``);
- ``slimming``: a learned [0, 1] coefficient per neuron under an L1 penalty;
- ``hard-concrete``: a learned L0 (hard-concrete) gate per neuron.

Losses and positions start at ``data.prompt_len`` (the memorized continuation), or cover the whole
row when it is None.

**Score cache and timing.** The score does not depend on `ratio` and is most of the cost, so it
is kept in this process (:class:`~gss_bench.baselines.interface.SharedWork`: per live model and data
object, dropped when the weights change, keyed by the score's hyperparameters): a grid over
ratios scores once. Slimming and hard-concrete keep their training state there, so a grid over
epochs 1, 10, 20 trains 20 epochs in all and reads the shorter runs from per-epoch snapshots (the
same as separate runs: batches are not shuffled and the gate noise comes from a kept generator).
``Method.run`` times only what the call itself did; each result's ``info`` states the score's
cost:

- ``score_seconds`` (also ``shared_seconds``): what computing this score from scratch took (for
  a resumed training, all of its epochs);
- ``reused_seconds``: the part of that this call did not spend (it came from the cache);
- ``cached_score``: whether anything was reused.

So ``result.total_seconds`` (``seconds + reused_seconds``) is a grid point's full price.

Differences from TinyMem's code, each towards what the method is meant to do:

- a ratio below ``1 / width`` ablates one neuron (TinyMem floors ``k`` to 0, so its ratio 0.001
  ablated nothing at width 128 or 512);
- zero-out follows MemPi: it zeroes the one neuron and scores the loss after the prompt
  (TinyMem's patch multiplied the activations by a one-hot vector, keeping *only* that neuron,
  and scored the whole row);
- slimming and hard-concrete zero the gradients every step and apply the stop rule after every
  100th / 10th epoch (TinyMem accumulated gradients over an epoch's batches, and its stop check
  sat in the batch loop, where the ``break`` ended only that epoch); padding is not scored.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from gss.errors import GSSError
from gss.hf.blocks import find_decoder_blocks
from gss.hf.forward import (
    accepts_position_ids,
    cache_argument,
    model_device,
    returned_cache,
    vocab_size,
)
from gss.steering.attach import split_block_output
from gss_bench.baselines.interface import (
    Mitigation,
    MitigationData,
    SharedWork,
    register,
    reuse_info,
)
from gss_bench.baselines.mlp import (
    MLP,
    mlp_layers,
    neuron_activations,
    scaled_neurons,
    weight_of,
    zero_neurons,
)
from gss_bench.baselines.training import edited_copy, loss_mask, row_batches, token_nll

RATIOS = (0.001, 0.01, 0.05)
EPOCHS = (1, 10, 20)
BATCH = 64  # rows of U per batch, as in TinyMem
_TOKEN_BUDGET = 16384  # tokens in one expanded zero-out forward
_FLOAT_BUDGET = 1 << 25  # floats in one chunk's logits or repeated KV cache (128 MiB in fp32)

# Hard-concrete gate constants (Louizos et al. 2018, as in TinyMem).
_BETA, _LEFT, _RIGHT = 2.0 / 3.0, -0.1, 1.1


# --- checks ---------------------------------------------------------------------------------------


def neurons_to_ablate(width: int, ratio: float) -> int:
    """How many of a layer's `width` neurons `ratio` ablates: ``max(1, floor(width * ratio))``."""
    return min(width, max(1, math.floor(width * ratio)))


def _check_ratio(ratio: Any) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise GSSError(
            f"ratio must be the fraction of each layer's MLP neurons to ablate, in (0, 1]; got "
            f"{ratio!r} (TinyMem's grid is 0.001, 0.01, 0.05)."
        )
    return float(ratio)


def _check_positive(name: str, value: Any, integer: bool = False) -> None:
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        what = "integer" if integer else "number"
        raise GSSError(f"{name} must be a positive {what}, got {value!r}.")


def _no_positions(data: MitigationData) -> GSSError:
    return GSSError(
        f"no memorized row has a token after the prompt (prompt_len={data.prompt_len}): the "
        "neuron scores are taken on the memorized continuation. Pass rows longer than the prompt."
    )


def _check_rows(data: MitigationData) -> None:
    """At least one row must have a scored token (after the prompt) before anything runs."""
    if not any(len(row) > max(data.prompt_len or 1, 1) for row in data.memorized):
        raise _no_positions(data)


# --- score cache ----------------------------------------------------------------------------------

_SCORES = SharedWork(max_entries=16)


def clear_score_cache() -> None:
    """Forget every cached score: the next call of each method scores from scratch."""
    _SCORES.clear()


def _cached_scores(
    key: tuple, model: nn.Module, data: MitigationData, compute: Callable[[], list[Tensor]]
) -> tuple[list[Tensor], dict[str, Any]]:
    """The scores from the cache, or computed (and timed) now, with their `info` entries."""

    def run() -> list[Tensor]:
        return [score.detach().float().cpu() for score in compute()]

    scores, seconds, reused = _SCORES.get(model, data, key, run)
    return scores, {**reuse_info(seconds, reused), "score_seconds": seconds, "cached_score": reused}


# --- shared pieces --------------------------------------------------------------------------------


def _ablate(
    edited: nn.Module, layers: list[MLP], scores: list[Tensor], ratio: float, info: dict
) -> Mitigation:
    """Zero each layer's top-k neurons by score in `edited` (ties go to the lower index)."""
    chosen = []
    for mlp, score in zip(layers, scores, strict=True):
        order = torch.sort(torch.nan_to_num(score, nan=-math.inf), descending=True, stable=True)
        neurons = order.indices[: neurons_to_ablate(mlp.width, ratio)]
        zero_neurons(mlp, neurons)
        chosen.append(sorted(neurons.tolist()))
    info = {**info, "ablated": [len(c) for c in chosen], "neurons": chosen}
    return Mitigation(edited, info=info)


def _output_vectors(mlp: MLP) -> Tensor:
    """(width, d) float32: row i is neuron i's output vector."""
    weight, dim = mlp.neuron_outputs()
    weight = weight.detach().float()
    return weight if dim == 0 else weight.t()


def _batch_loss(model: nn.Module, ids: Tensor, mask: Tensor, start: int | None) -> Tensor:
    """Token-weighted mean next-token NLL over the scored targets (differentiable)."""
    nll = token_nll(model, ids, mask)
    weights = loss_mask(mask, start).to(nll.device)
    return (nll * weights).sum() / weights.sum().clamp_min(1.0)


@contextmanager
def _gated(layers: list[MLP], gate: Callable[[int], Tensor]) -> Iterator[None]:
    """Multiply layer i's neuron activations by ``gate(i)``, evaluated afresh at every forward."""

    def make(i: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> tuple:
            g = gate(i).to(device=args[0].device, dtype=args[0].dtype)
            return (args[0] * g, *args[1:])

        return hook

    handles = [mlp.down.register_forward_pre_hook(make(i)) for i, mlp in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _recorded(layers: list[MLP], stores: list[list[Tensor]]) -> Iterator[None]:
    """Record every layer's neuron activations into its store."""
    with ExitStack() as stack:
        for mlp, store in zip(layers, stores, strict=True):
            stack.enter_context(neuron_activations(mlp, store))
        yield


# --- activation -----------------------------------------------------------------------------------


@torch.no_grad()
def activation_scores(model: nn.Module, layers: list[MLP], data: MitigationData) -> list[Tensor]:
    """Mean |activation| over U's scored positions, times the neuron's output-weight norm."""
    totals = [torch.zeros(m.width, dtype=torch.float64) for m in layers]
    count = 0.0
    for ids, mask in row_batches(data.memorized, BATCH, data.pad_id):
        stores: list[list[Tensor]] = [[] for _ in layers]
        with _recorded(layers, stores):
            token_nll(model, ids, mask)
        weights = loss_mask(mask, data.prompt_len)  # position p predicts token p + 1
        count += float(weights.sum())
        for total, (acts,) in zip(totals, stores, strict=True):
            w = weights.to(acts.device, torch.float32)
            total += torch.einsum("btn,bt->n", acts[:, :-1].float().abs(), w).double().cpu()
    if count == 0:
        raise _no_positions(data)
    return [
        (total / count).float() * mlp.output_norms().cpu()
        for total, mlp in zip(totals, layers, strict=True)
    ]


@register(
    "act",
    "neuron",
    [{"ratio": r} for r in RATIOS],
    "ablate the MLP neurons with the largest mean |activation| x output-weight norm on U",
    stronger=("ratio",),
)
def act(model: nn.Module, data: MitigationData, ratio: float = 0.01) -> Mitigation:
    """Activation magnitude: cheap (one pass over U), blind to what the neuron does."""
    ratio = _check_ratio(ratio)
    _check_rows(data)
    edited = edited_copy(model)
    layers = mlp_layers(edited)
    scores, info = _cached_scores(
        ("act",), model, data, lambda: activation_scores(edited, layers, data)
    )
    return _ablate(edited, layers, scores, ratio, info)


# --- zero-out -------------------------------------------------------------------------------------


_Blocks = Sequence[nn.Module] | nn.ModuleList  # a ModuleList is no Sequence to the type checker


@contextmanager
def _replayed(blocks: _Blocks, output: Any) -> Iterator[None]:
    """Blocks that return `output` at once instead of computing (restored afterwards)."""

    def replay(*args: Any, **kwargs: Any) -> Any:
        return output

    saved = [block.__dict__.get("forward") for block in blocks]
    for block in blocks:
        block.forward = replay
    try:
        yield
    finally:
        for block, own in zip(blocks, saved, strict=True):
            if own is None:
                del block.forward
            else:
                block.forward = own


def _group_scale(width: int, chunk: Tensor, rows: int) -> Tensor:
    """(G * rows, 1, width) ones, with neuron ``chunk[g]`` zeroed in group g's rows."""
    scale = torch.ones(len(chunk), width)
    scale[torch.arange(len(chunk)), chunk] = 0.0
    return scale.repeat_interleave(rows, dim=0).unsqueeze(1)


def _zeroed_nll(model: nn.Module, mlp: MLP, chunk: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
    """Token NLL of the rows repeated once per neuron of `chunk`, that neuron zeroed in its copy."""
    scale = _group_scale(mlp.width, chunk, len(ids)).to(weight_of(mlp.down).device)
    with scaled_neurons(mlp, scale):
        return token_nll(model, ids.repeat(len(chunk), 1), mask.repeat(len(chunk), 1))


@dataclass
class _BatchRun:
    """One unablated pass over a batch: every block's output and every layer's activations."""

    outputs: list[Any]
    activations: list[Tensor]
    nll: Tensor


def _run_batch(
    model: nn.Module, blocks: _Blocks, layers: list[MLP], ids: Tensor, mask: Tensor
) -> _BatchRun:
    outputs: list[Any] = [None] * len(blocks)

    def keeper(i: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs[i] = output

        return hook

    stores: list[list[Tensor]] = [[] for _ in layers]
    hooks = [block.register_forward_hook(keeper(i)) for i, block in enumerate(blocks)]
    try:
        with _recorded(layers, stores):
            nll = token_nll(model, ids, mask)
    finally:
        for hook in hooks:
            hook.remove()
    return _BatchRun(outputs, [store[0] for store in stores], nll)


def _replayed_nll(
    model: nn.Module,
    blocks: _Blocks,
    layer: int,
    run: _BatchRun,
    vectors: Tensor,
    chunk: Tensor,
    ids: Tensor,
    mask: Tensor,
) -> Tensor:
    """`_zeroed_nll` computed from block `layer`'s kept output minus the neuron's contribution."""
    hidden, rebuild = split_block_output(run.outputs[layer])
    acts = run.activations[layer]
    a = acts[..., chunk.to(acts.device)].permute(2, 0, 1).unsqueeze(-1).float()  # (G, B, T, 1)
    v = vectors[chunk].to(a.device)[:, None, None, :]  # (G, 1, 1, d)
    edited = (hidden.float().unsqueeze(0) - a * v).flatten(0, 1).to(hidden.dtype)
    with _replayed(blocks[: layer + 1], rebuild(edited)):
        return token_nll(model, ids.repeat(len(chunk), 1), mask.repeat(len(chunk), 1))


def zero_out_estimate(model: nn.Module, layers: list[MLP], data: MitigationData) -> list[Tensor]:
    """First-order zero-out scores from one backward pass over U: ``-sum a_i dL/da_i``, the
    gradient of the mean loss after the prompt w.r.t. a per-neuron scale at 1, negated."""
    scales = [torch.ones(m.width, device=model_device(model), requires_grad=True) for m in layers]
    grads = [torch.zeros(m.width, dtype=torch.float64) for m in layers]
    count = 0.0
    with _gated(layers, lambda i: scales[i]), torch.enable_grad():
        for ids, mask in row_batches(data.memorized, BATCH, data.pad_id):
            nll = token_nll(model, ids, mask)
            weights = loss_mask(mask, data.prompt_len).to(nll.device)
            count += float(weights.sum())
            step = torch.autograd.grad((nll * weights).sum(), scales)
            for total, grad in zip(grads, step, strict=True):
                total -= grad.double().cpu()
    if count == 0:
        raise _no_positions(data)
    return [(g / count).float() for g in grads]


def _ranked_after(exact: Tensor, scored: Tensor, estimate: Tensor) -> Tensor:
    """Exact scores for the `scored` neurons; every other neuron below them, in estimate order.

    The rest get ``min(exact) - 1 - rank``: whole steps, since shifting the estimates themselves
    by about 1 rounded estimates closer than float32's spacing there (6e-8) into ties."""
    out = exact.clone()
    rest = torch.ones_like(estimate, dtype=torch.bool)
    rest[scored] = False
    if rest.any():
        order = torch.sort(estimate[rest], descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        out[rest] = exact[scored].min() - 1.0 - rank.to(out.dtype)
    return out


@torch.no_grad()
def zero_out_scores(
    model: nn.Module,
    layers: list[MLP],
    data: MitigationData,
    candidates: float = 1.0,
    fast: bool = True,
    report: dict[str, Any] | None = None,
) -> list[Tensor]:
    """Mean loss on U (after the prompt) with one neuron zeroed, minus the unablated loss.

    Zeroing neuron i of block l removes exactly ``a_i(x) w_i`` from that block's output. So with
    `fast`, each batch runs the model once, keeping every block's output and activations, and
    per group of neurons replays blocks 0..l (their forward returns the kept output of block l
    minus each neuron's contribution) and computes only the blocks after l. The first batch
    checks this against plain forwards with the neurons zeroed, once per layer, and falls back
    to plain forwards if they differ (a block that normalizes its MLP output, say). Neurons
    that are 0 on a whole batch change nothing there and are skipped.

    With `candidates` < 1, only that fraction of each layer (the highest by
    :func:`zero_out_estimate`) is scored exactly; the rest rank below them, by the estimate.
    """
    blocks = find_decoder_blocks(model)
    if len(blocks) != len(layers):
        raise GSSError(f"found {len(blocks)} decoder blocks but {len(layers)} MLPs.")
    if candidates < 1.0:
        estimate = zero_out_estimate(model, layers, data)
        todo = [
            torch.sort(e, descending=True, stable=True).indices[: math.ceil(len(e) * candidates)]
            for e in estimate
        ]
    else:
        todo = [torch.arange(m.width) for m in layers]
    vocab = vocab_size(model)
    vectors = [_output_vectors(m) for m in layers]
    sums = [torch.zeros(m.width, dtype=torch.float64) for m in layers]
    base_sum, count, forwards = 0.0, 0.0, 0
    checked: set[int] = set()  # layers whose replay was compared with a plain forward
    for ids, mask in row_batches(data.memorized, BATCH, data.pad_id):
        weights = loss_mask(mask, data.prompt_len)
        if not weights.any():
            continue
        run = _run_batch(model, blocks, layers, ids, mask)
        w = weights.to(run.nll.device)
        base_sum += float((run.nll * w).sum())
        count += float(w.sum())
        groups = max(1, min(_TOKEN_BUDGET, _FLOAT_BUDGET // vocab) // ids.numel())
        for layer, mlp in enumerate(layers):
            live = (run.activations[layer] != 0).flatten(0, 1).any(dim=0).cpu()
            neurons = todo[layer][live[todo[layer]]]
            sums[layer][todo[layer][~live[todo[layer]]]] += float((run.nll * w).sum())
            for chunk in neurons.split(groups):
                forwards += 1
                if fast:
                    nll = _replayed_nll(model, blocks, layer, run, vectors[layer], chunk, ids, mask)
                    if layer not in checked:
                        checked.add(layer)
                        plain = _zeroed_nll(model, mlp, chunk, ids, mask)
                        if not torch.allclose(nll, plain, rtol=1e-3, atol=1e-4):
                            fast, nll = False, plain
                else:
                    nll = _zeroed_nll(model, mlp, chunk, ids, mask)
                per_neuron = (nll.view(len(chunk), len(ids), -1) * w).sum(dim=(1, 2))
                sums[layer][chunk] += per_neuron.double().cpu()
    if count == 0:
        raise _no_positions(data)
    scores = [((s - base_sum) / count).float() for s in sums]
    if candidates < 1.0:
        scores = [_ranked_after(s, t, e) for s, t, e in zip(scores, todo, estimate, strict=True)]
    if report is not None:
        report.update(replayed=fast, forwards=forwards, exact=[len(t) for t in todo])
    return scores


ZERO_OUT_CANDIDATES = 0.125
ZERO_OUT_MAX_ROWS = 128
IG_MAX_POSITIONS = 5_000


def _sampled_rows(data: MitigationData, max_rows: int | None) -> MitigationData:
    """`data` with U cut to a fixed (seed 0) uniform sample of `max_rows` rows, in U's order,
    when it has more; the same object otherwise."""
    if max_rows is None or len(data.memorized) <= max_rows:
        return data
    gen = torch.Generator().manual_seed(0)
    keep = sorted(torch.randperm(len(data.memorized), generator=gen)[:max_rows].tolist())
    return dataclasses.replace(data, memorized=[data.memorized[i] for i in keep])


@register(
    "zero-out",
    "neuron",
    [
        {"ratio": r, "candidates": ZERO_OUT_CANDIDATES, "max_rows": ZERO_OUT_MAX_ROWS}
        for r in RATIOS
    ],
    "ablate the MLP neurons whose zeroing alone raises the loss on U the most",
    reduced_grid=(
        "scores exactly only the 1/8 of each layer's neurons with the highest first-order "
        "estimate (one backward pass; the rest rank below, by the estimate), on at most "
        f"{ZERO_OUT_MAX_ROWS} rows of U (a fixed sample: the backdoor settings' U has 207-775 "
        "rows, and the cost grows with them: 271 s on 452 math backdoor rows). On the TinyMem "
        "math model (4 x 512 neurons, 162 rows of 101 tokens) the exact scores took 876 s; "
        "the candidates held 5/5 of each layer's exact top 5 and 21-25 of its top 25. "
        "candidates=1.0, max_rows=None is the full method"
    ),
    stronger=("ratio",),
)
def zero_out(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 0.01,
    candidates: float = 1.0,
    max_rows: int | None = None,
) -> Mitigation:
    """Zero-out: each neuron's direct effect on the memorized loss, one pass over U per neuron
    (per `candidates` neuron: the fraction of each layer scored exactly, see `zero_out_scores`;
    over a fixed sample of `max_rows` rows of U when it has more)."""
    ratio = _check_ratio(ratio)
    number = isinstance(candidates, int | float) and not isinstance(candidates, bool)
    if not number or not 0 < candidates <= 1:
        raise GSSError(
            f"candidates must be the fraction of each layer's neurons scored exactly, in (0, 1]; "
            f"got {candidates!r}."
        )
    if max_rows is not None:
        _check_positive("max_rows", max_rows, integer=True)
    scored = _sampled_rows(data, max_rows)
    _check_rows(scored)
    edited = edited_copy(model)
    layers = mlp_layers(edited)
    scores, info = _cached_scores(
        ("zero-out", float(candidates), max_rows),
        model,
        data,
        lambda: zero_out_scores(edited, layers, scored, candidates=float(candidates)),
    )
    return _ablate(edited, layers, scores, ratio, {**info, "rows_scored": len(scored.memorized)})


# --- integrated gradients -------------------------------------------------------------------------


def _repeat_cache(cache: Any, n: int) -> Any:
    """A copy of a one-row KV cache repeated `n` times along the batch."""
    if isinstance(cache, tuple):  # the legacy format: per layer (key, value)
        return tuple(tuple(t.repeat_interleave(n, dim=0) for t in layer) for layer in cache)
    repeated = copy.deepcopy(cache)
    repeated.batch_repeat_interleave(n)
    return repeated


def _cache_floats(cache: Any) -> int:
    """Floats one row of the cache holds (what each repeated item costs)."""
    if isinstance(cache, tuple):
        return sum(t.numel() for layer in cache for t in layer)
    total = 0
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            total += t.numel() if isinstance(t, Tensor) else 0
    for name in ("key_cache", "value_cache"):  # transformers 4.x
        total += sum(t.numel() for t in getattr(cache, name, ()) if isinstance(t, Tensor))
    return max(total, 1)


def _ig_positions(
    data: MitigationData, max_positions: int | None
) -> list[tuple[Sequence[int], Tensor]]:
    """(row, positions scored in it) for every row of U with positions after the prompt; when
    more than `max_positions` (row, position) pairs exist, a fixed (seed 0) uniform sample of
    that many, so the score costs the same on every run."""
    start = max((data.prompt_len or 1) - 1, 0)
    rows = [(row, torch.arange(start, len(row) - 1)) for row in data.memorized]
    rows = [(row, positions) for row, positions in rows if len(positions)]
    total = sum(len(positions) for _, positions in rows)
    if max_positions is None or total <= max_positions:
        return rows
    keep = torch.zeros(total, dtype=torch.bool)
    keep[torch.randperm(total, generator=torch.Generator().manual_seed(0))[:max_positions]] = True
    sampled, offset = [], 0
    for row, positions in rows:
        chosen = positions[keep[offset : offset + len(positions)]]
        offset += len(positions)
        if len(chosen):
            sampled.append((row, chosen))
    return sampled


def integrated_gradient_scores(
    model: nn.Module,
    layers: list[MLP],
    data: MitigationData,
    steps: int = 20,
    max_positions: int | None = None,
) -> list[Tensor]:
    """IG attribution of each neuron to the true next token's probability, averaged over the
    positions after the prompt of each row, then over rows (`max_positions`: score a fixed
    sample of that many (row, position) pairs instead of all).

    At position t the reference cuts the row to t + 1 tokens and scales the last position's
    activations by alpha. Positions before t do not depend on t, so this runs the row once to
    keep its KV cache and then each (t, alpha) as a single token at position t on that cache,
    with cache entries from t on masked out: the same computation, one token per item instead of
    t + 1. The items of a layer are batched.
    """
    device = model_device(model)
    cache_name, use_pos = cache_argument(model), accepts_position_ids(model)
    alphas = torch.linspace(0.0, 1.0, steps)
    totals = [torch.zeros(m.width, dtype=torch.float64) for m in layers]
    used = 0
    for row, positions in _ig_positions(data, max_positions):
        ids = torch.tensor([list(row)], dtype=torch.long, device=device)
        with torch.no_grad():
            cache = returned_cache(model(input_ids=ids, use_cache=True))
        if cache is None:
            raise GSSError(
                f"{type(model).__name__} returned no KV cache with use_cache=True; the "
                "integrated-gradients baseline reuses the row's cache for every position."
            )
        item_t = positions.repeat_interleave(steps)
        item_alpha = alphas.repeat(len(positions))
        chunk = max(1, _FLOAT_BUDGET // _cache_floats(cache))
        scale = 1.0 / (steps * len(positions))
        for layer, mlp in enumerate(layers):
            for sl in torch.arange(len(item_t)).split(chunk):
                items = (ids[0], cache, item_t[sl], item_alpha[sl])
                attribution = _ig_chunk(model, mlp, *items, device, cache_name, use_pos)
                totals[layer] += attribution.double().cpu() * scale
        used += 1
    if used == 0:
        raise _no_positions(data)
    return [(t / used).float() for t in totals]


def _ig_chunk(
    model: nn.Module,
    mlp: MLP,
    row: Tensor,
    cache: Any,
    t: Tensor,
    alpha: Tensor,
    device: torch.device,
    cache_name: str,
    use_pos: bool,
) -> Tensor:
    """Sum over items of ``a * d p(row[t + 1]) / d(alpha a)`` at position t of `mlp`'s layer
    (`cache_name`, `use_pos`: how the model takes its cache and positions, found once)."""
    n, length = len(t), len(row)
    t = t.to(device)
    attention = torch.cat(
        [
            (torch.arange(length, device=device) < t[:, None]).long(),
            torch.ones(n, 1, dtype=torch.long, device=device),
        ],
        dim=1,
    )
    kwargs: dict[str, Any] = {
        "input_ids": row[t].unsqueeze(1),
        "attention_mask": attention,
        cache_name: _repeat_cache(cache, n),
        "use_cache": True,
    }
    if use_pos:
        kwargs["position_ids"] = t.unsqueeze(1)
    seen: dict[str, Tensor] = {}

    def scale(module: nn.Module, args: tuple) -> tuple:
        a = args[0].detach()
        seen["a"] = a
        seen["z"] = (a * alpha.to(a.device, a.dtype).view(-1, 1, 1)).requires_grad_(True)
        return (seen["z"], *args[1:])

    handle = mlp.down.register_forward_pre_hook(scale)
    try:
        with torch.enable_grad():
            logits = model(**kwargs).logits[:, -1].float()
            probs = torch.softmax(logits, dim=-1)
            target = probs.gather(1, row[t + 1].unsqueeze(1).to(probs.device)).sum()
            (grad,) = torch.autograd.grad(target, seen["z"])
    finally:
        handle.remove()
    return (seen["a"].float() * grad.float()).sum(dim=(0, 1))


@register(
    "ig",
    "neuron",
    [{"ratio": r, "max_positions": IG_MAX_POSITIONS} for r in RATIOS],
    "ablate the MLP neurons with the largest integrated-gradients attribution to U's tokens",
    reduced_grid=(
        f"scores a fixed sample of at most {IG_MAX_POSITIONS:,} (row, position) pairs of U "
        "(each costs steps x layers single-token passes, 40-55 per second on this CPU): all of "
        "them on TinyMem math noise (88 x 50) and language noise, 6% of math backdoor's "
        "681 x 120 (all of 452 x 120 took 28 min), 38% of language backdoor's 207 x 64. "
        "max_positions=None is the full method"
    ),
    stronger=("ratio",),
)
def ig(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 0.01,
    steps: int = 20,
    max_positions: int | None = None,
) -> Mitigation:
    """Integrated gradients (zero baseline, `steps` alphas evenly spaced in [0, 1]), over all
    positions of U after the prompt or a fixed sample of `max_positions` of them."""
    ratio = _check_ratio(ratio)
    _check_rows(data)
    _check_positive("steps", steps, integer=True)
    if max_positions is not None:
        _check_positive("max_positions", max_positions, integer=True)
    edited = edited_copy(model)
    layers = mlp_layers(edited)
    scores, info = _cached_scores(
        ("ig", steps, max_positions),
        model,
        data,
        lambda: integrated_gradient_scores(edited, layers, data, steps, max_positions),
    )
    return _ablate(edited, layers, scores, ratio, info)


# --- slimming and hard concrete -------------------------------------------------------------------


class _GateTraining:
    """Resumable training of one gate per neuron on U, with the score kept after every epoch."""

    def __init__(
        self,
        kind: str,
        widths: list[int],
        device: torch.device,
        lr: float,
        lam: float,
        stop_loss: float,
        seed: int,
    ) -> None:
        self.kind, self.widths, self.device, self.lr, self.seed = kind, widths, device, lr, seed
        self.lam, self.stop_loss = lam, stop_loss
        self.check_every = 100 if kind == "slimming" else 10
        self.restart()

    def restart(self) -> None:
        """Back to epoch 0 (also after an interrupted epoch, which cannot be resumed)."""
        self.generator = torch.Generator().manual_seed(self.seed)
        if self.kind == "slimming":
            self.params = [
                torch.ones(w, device=self.device, requires_grad=True) for w in self.widths
            ]
        else:  # log alpha ~ N(0, 0.01^2)
            self.params = [
                (torch.randn(w, generator=self.generator) * 0.01).to(self.device).requires_grad_()
                for w in self.widths
            ]
        self.optimizer = torch.optim.Adam(self.params, lr=self.lr)
        self.epochs, self.stopped, self.seconds = 0, False, 0.0
        self.snapshots: dict[int, tuple[list[Tensor], float]] = {}

    def gate(self, i: int) -> Tensor:
        p = self.params[i]
        if self.kind == "slimming":
            return p.clamp(0.0, 1.0)
        u = torch.rand(p.shape, generator=self.generator).clamp(1e-4, 1 - 1e-4).to(p.device)
        s = torch.sigmoid((u.log() - (1 - u).log() + p) / _BETA)
        return (s * (_RIGHT - _LEFT) + _LEFT).clamp(0.0, 1.0)

    def penalty(self) -> Tensor:
        """Slimming: ||m||_1 / #neurons. Hard concrete: the mean of P(gate != 0) per layer."""
        if self.kind == "slimming":
            total = cast(Tensor, sum(p.abs().sum() for p in self.params))  # params: never empty
            return total / sum(p.numel() for p in self.params)
        shift = _BETA * math.log(-_LEFT / _RIGHT)
        return torch.stack([torch.sigmoid(p - shift).mean() for p in self.params]).mean()

    def scores(self) -> list[Tensor]:
        with torch.no_grad():
            if self.kind == "slimming":
                return [p.clamp(0.0, 1.0).cpu() for p in self.params]
            return [torch.sigmoid(p).cpu() for p in self.params]

    def train_to(
        self, epochs: int, model: nn.Module, layers: list[MLP], data: MitigationData
    ) -> None:
        while self.epochs < epochs and not self.stopped:
            t0 = time.perf_counter()
            with _gated(layers, self.gate), torch.enable_grad():
                for ids, mask in row_batches(data.memorized, BATCH, data.pad_id):
                    loss = _batch_loss(model, ids, mask, data.prompt_len)
                    loss = loss + self.lam * self.penalty()
                    self.optimizer.zero_grad()
                    loss.backward()
                    self.optimizer.step()
            self.epochs += 1
            if self.epochs % self.check_every == 0:
                with torch.no_grad():
                    self.stopped = float(self.penalty()) < self.stop_loss
            self.seconds += time.perf_counter() - t0
            self.snapshots[self.epochs] = (self.scores(), self.seconds)

    def at(self, epochs: int) -> tuple[list[Tensor], float]:
        """The scores after `epochs` epochs (or at the early stop) and what they took."""
        return self.snapshots[min(epochs, self.epochs)]


def _gate_method(
    kind: str,
    model: nn.Module,
    data: MitigationData,
    ratio: float,
    epochs: int,
    lr: float,
    lam: float,
    stop_loss: float,
    seed: int = 0,
) -> Mitigation:
    ratio = _check_ratio(ratio)
    _check_rows(data)
    _check_positive("epochs", epochs, integer=True)
    _check_positive("lr", lr)
    for name, value in (("lam", lam), ("stop_loss", stop_loss)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise GSSError(f"{name} must be a number >= 0, got {value!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise GSSError(f"seed must be an integer, got {seed!r}.")
    edited = edited_copy(model)
    layers = mlp_layers(edited)
    widths, device = [m.width for m in layers], model_device(edited)
    training, _, _ = _SCORES.get(
        model,
        data,
        (kind, float(lr), float(lam), float(stop_loss), seed),
        lambda: _GateTraining(kind, widths, device, lr, lam, stop_loss, seed),
    )
    done, spent = training.epochs, training.seconds
    try:
        training.train_to(epochs, edited, layers, data)
    except BaseException:
        training.restart()
        raise
    scores, seconds = training.at(epochs)
    info = {
        **reuse_info(seconds, False),
        "reused_seconds": min(seconds, spent),  # epochs trained by earlier calls
        "score_seconds": seconds,
        "cached_score": done > 0,
        "epochs_trained": min(epochs, training.epochs),
        "stopped_early": training.stopped and training.epochs < epochs,
    }
    return _ablate(edited, layers, scores, ratio, info)


@register(
    "slimming",
    "neuron",
    [{"ratio": r, "epochs": e} for r in RATIOS for e in EPOCHS],
    "ablate the MLP neurons whose learned L1-penalized coefficient stays highest on U",
    stronger=("ratio",),
)
def slimming(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 0.01,
    epochs: int = 10,
    lr: float = 0.1,
    lam: float = 1000.0,
    stop_loss: float = 0.1,
) -> Mitigation:
    """Slimming: coefficients m in [0, 1] (init 1) minimize LM(U) + lam * ||m||_1 / #neurons with
    Adam; the neurons memorization still needs keep a high m. Stops when the L1 term (without
    lam) falls below `stop_loss`, checked every 100 epochs."""
    return _gate_method("slimming", model, data, ratio, epochs, lr, lam, stop_loss)


@register(
    "hard-concrete",
    "neuron",
    [{"ratio": r, "epochs": e} for r in RATIOS for e in EPOCHS],
    "ablate the MLP neurons whose learned hard-concrete (L0) gate stays most open on U",
    stronger=("ratio",),
)
def hard_concrete(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 0.01,
    epochs: int = 10,
    lr: float = 0.1,
    lam: float = 1000.0,
    stop_loss: float = 0.1,
    seed: int = 0,
) -> Mitigation:
    """Hard concrete: stochastic L0 gates (temperature 2/3, stretch (-0.1, 1.1)) minimize
    LM(U) + lam * mean P(gate open) with Adam; score sigmoid(log alpha). Stops when the penalty
    (without lam) falls below `stop_loss`, checked every 10 epochs."""
    return _gate_method("hard-concrete", model, data, ratio, epochs, lr, lam, stop_loss, seed)
