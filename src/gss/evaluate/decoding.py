"""Row inputs normalised, and the two ways the metrics decode: stepwise greedy and forced."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from gss.config import EVALUATION_BATCH_SIZE, METRIC_BATCH_SIZE
from gss.data import right_pad
from gss.errors import GSSError
from gss.hf.forward import (
    accepts,
    accepts_position_ids,
    cache_argument,
    forward_logits,
    model_device,
    output_logits,
    position_ids_from_mask,
    returned_cache,
)

RowsLike = Sequence[Sequence[int]] | torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no grad for the duration; the model's previous mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def batch_starts(count: int, batch_size: int, desc: str, progress: bool) -> Iterable[int]:
    """The first row of every batch, counted by a progress bar (in batches) when `progress`:
    a 7B model's greedy decoding of a few hundred candidates takes minutes."""
    starts = range(0, count, batch_size)
    return tqdm(starts, desc=desc, disable=not progress, leave=False, unit="batch")


def as_rows(rows: RowsLike, pad_id: int | None = None) -> list[list[int]]:
    """Rows as lists of ints, without padding.

    Accepts a sequence of sequences (or 1-d tensors) taken as given, an ``(input_ids,
    attention_mask)`` pair (rows keep their masked-in tokens), or a 2-d tensor whose right
    padding is the trailing run of `pad_id` (required then).
    """
    if isinstance(rows, tuple) and len(rows) == 2 and all(torch.is_tensor(t) for t in rows):
        ids, mask = rows
        return [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]
    if torch.is_tensor(rows):
        if rows.dim() != 2:
            raise ValueError("a tensor of rows must be 2-d (rows, tokens)")
        if pad_id is None:
            return rows.tolist()
        out = []
        for r in rows.tolist():
            n = len(r)
            while n and r[n - 1] == pad_id:
                n -= 1
            out.append(r[:n])
        return out
    return [r.tolist() if torch.is_tensor(r) else list(r) for r in rows]


def greedy_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    pad_id: int,
    batch_size: int = METRIC_BATCH_SIZE,
    progress: bool = False,
    choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
    desc: str = "gss: greedy decoding",
    processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> list[list[int]]:
    """Greedy continuations of `prompts`, `max_new_tokens` each, with the model's KV cache.

    Runs the model's own forward step by step (no `generate`, so no generation-config defaults
    such as sampling or minimum lengths apply, and EOS does not stop a row). Prompts of different
    lengths are left-padded with an attention mask and matching position ids; batches group
    prompts of equal length first so that most batches need no padding. A model that returns
    no KV cache, or whose forward takes none back (a plain `nn.Module`, a forward-only
    wrapper), is given the whole sequence at every step. ``choose`` replaces the argmax: it
    maps the last position's logits (B, V) to the next tokens (B, 1) (`sample_generate`).
    ``processor``: a transformers ``LogitsProcessor`` (``(ids so far, scores) -> scores``) run
    on those logits first (`gss.reference_where_open`'s).
    """
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    use_pos = accepts_position_ids(model)
    use_mask, use_cache = accepts(model, "attention_mask"), accepts(model, "use_cache")
    cache_name = cache_argument(model)
    takes_cache = accepts(model, cache_name)  # a forward-only wrapper may return one anyway
    device = model_device(model)
    with eval_mode(model):
        for b in batch_starts(len(order), batch_size, desc, progress):
            idx = order[b : b + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for j, i in enumerate(idx):
                p = list(prompts[i])
                ids[j, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
                mask[j, width - len(p) :] = 1
            ids, mask = ids.to(device), mask.to(device)
            if not use_mask and not bool(mask.all()):
                raise GSSError(
                    "the model's forward takes no attention_mask, so prompts of different "
                    "lengths cannot be decoded in one batch: pass batch_size=1, or give its "
                    "forward an attention_mask."
                )
            pos = position_ids_from_mask(mask)
            past = None
            step_ids = ids
            new: list[torch.Tensor] = []
            for _ in range(max_new_tokens):
                kwargs: dict[str, Any] = {"attention_mask": mask} if use_mask else {}
                if use_cache:
                    kwargs["use_cache"] = True
                if use_pos:
                    kwargs["position_ids"] = pos
                if past is not None:
                    kwargs[cache_name] = past
                res = model(input_ids=step_ids, **kwargs)
                past = returned_cache(res) if takes_cache else None
                last = output_logits(res)[:, -1, :]
                if processor is not None:
                    last = processor(torch.cat([ids, *new], dim=1), last)
                chosen = last.argmax(-1, keepdim=True) if choose is None else choose(last)
                new.append(chosen)
                mask = torch.cat([mask, torch.ones_like(chosen)], dim=1)
                if past is None:  # no cache: the next step reads the whole sequence again
                    step_ids = torch.cat([step_ids, chosen], dim=1)
                    pos = position_ids_from_mask(mask)
                else:
                    step_ids = chosen
                    pos = pos[:, -1:] + 1
            gen = torch.cat(new, dim=1).tolist()
            for j, i in enumerate(idx):
                out[i] = gen[j]
    return out


def sample_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    generator: torch.Generator,
    pad_id: int = 0,
    batch_size: int = EVALUATION_BATCH_SIZE,
    progress: bool = False,
    desc: str = "gss: sampling",
) -> list[list[int]]:
    """As `greedy_generate`, but each token sampled at temperature 1 from the float32 softmax
    on the CPU, one draw per row of a batch at each step from ``generator`` (seeded: the same
    text on every run)."""

    def sample(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float().cpu(), -1)
        return torch.multinomial(probs, 1, generator=generator).to(logits.device)

    return greedy_generate(
        model,
        prompts,
        max_new_tokens,
        pad_id=pad_id,
        batch_size=batch_size,
        progress=progress,
        choose=sample,
        desc=desc,
    )


def forced_argmax(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    *,
    pad_id: int,
    batch_size: int = METRIC_BATCH_SIZE,
    progress: bool = False,
) -> list[list[int]]:
    """Teacher-forced argmax predictions at the target positions of ``prompt + target``.

    Greedy decoding reproduces a target exactly iff these predictions equal the target
    everywhere, so this gives the same exact-match answer in one forward pass per batch.
    """
    seqs = [list(p) + list(t) for p, t in zip(prompts, targets, strict=True)]
    out: list[list[int]] = []
    with eval_mode(model):
        for b in batch_starts(len(seqs), batch_size, "gss: teacher-forced pass", progress):
            chunk = seqs[b : b + batch_size]
            ids, mask = right_pad(chunk, pad_id)
            pred = forward_logits(model, ids, mask).argmax(-1).cpu()
            for j, s in enumerate(chunk):
                start = len(prompts[b + j])
                out.append(pred[j, start - 1 : len(s) - 1].tolist())
    return out
