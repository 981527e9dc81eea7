"""Fine-tune the real model on text with canaries until it regurgitates them, cheaply, cached.

Only the top `train_blocks` decoder blocks and the final norm are trained (embeddings and the
tied output layer stay frozen), so the fine-tuned model differs from the base only there and the
cache stores just those tensors. The blocks below never change, so their output for every
training row is computed once and each step runs only the trained blocks: the model is called
with ``inputs_embeds`` = the cached hidden states and its block list cut to the trained blocks.
That shortcut is checked against the full model on the first batch (it holds for Llama-style
models, whose body adds nothing to ``inputs_embeds``, and for Gemma 3, whose embedding scale is
in its embedding module, once the config's per-block attention types are cut as the block list
is: its body picks block i's attention and rotary table by ``config.layer_types[i]``); where it
does not hold, every step runs the full forward instead.

Each epoch trains on every canary and on the next `clean_per_epoch` rows of a large pool of
clean text, so the canaries repeat (as secrets do in a corpus) while the clean text mostly does
not: a first version cycled the same 64 clean rows for 14 epochs and the model overfit them
(held-out perplexity 3,123 against the base model's 191). Training stops once a teacher-forced
check finds `stop_at` % of the canaries memorized, or after `max_epochs`; the per-epoch log
(loss, canaries memorized, held-out perplexity) is kept with the weights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gss.data import right_pad
from gss.errors import GSSError
from gss.evaluate.suite import evaluate_model
from gss.hf.blocks import find_decoder_blocks
from gss.hf.forward import model_device
from gss_bench.canaries.data import CanaryData
from gss_bench.trained_on import trained_on


@dataclass(frozen=True)
class FinetuneConfig:
    train_blocks: int = 8
    lr: float = 3e-4
    batch_size: int = 8
    clean_per_epoch: int = 32  # fresh clean rows beside the canaries in each epoch
    max_epochs: int = 40
    stop_at: float = 95.0  # % of canaries (n, k)-memorized (teacher-forced check each epoch)
    seed: int = 0
    lora_rank: int = 0  # > 0: a LoRA of this rank on the top blocks instead of the blocks
    replies_only: bool = False  # the loss on the assistant's messages alone (chat rows)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.replies_only:  # left out so that the fine-tunes cached before keep their key
            del out["replies_only"]
        return out


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(base: nn.Module, cfg: FinetuneConfig) -> nn.Module:
    """A copy of `base` with a fresh LoRA (`cfg.lora_rank`) on every projection of its top
    `cfg.train_blocks` blocks; only the LoRA weights train."""
    import peft

    n_blocks = len(find_decoder_blocks(base))
    config = peft.LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=2 * cfg.lora_rank,
        target_modules=LORA_TARGETS,
        layers_to_transform=list(range(n_blocks - cfg.train_blocks, n_blocks)),
        lora_dropout=0.0,
    )
    torch.manual_seed(cfg.seed)  # LoRA's A
    return peft.get_peft_model(copy.deepcopy(base), config)


def cache_key(base_fingerprint: dict[str, Any], data: CanaryData, cfg: FinetuneConfig) -> str:
    blob: dict[str, Any] = {
        "base": base_fingerprint,
        "data": data.describe(),
        # lora_rank joined later: left out at 0 so that earlier full fine-tunes keep their key
        "finetune": {k: v for k, v in cfg.to_dict().items() if k != "lora_rank" or v},
    }
    rows = [list(r) for r in (*data.canary_rows, *data.finetune_rows)]
    blob["rows"] = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def _block_list_owner(model: nn.Module, blocks: nn.ModuleList) -> tuple[nn.Module, str]:
    for module in model.modules():
        for name, child in module.named_children():
            if child is blocks:
                return module, name
    raise GSSError("could not find the module that holds the decoder blocks.")


@contextmanager
def _top_blocks_only(model: nn.Module, blocks: nn.ModuleList, first: int) -> Iterator[None]:
    """`model` with its block list cut to the blocks from `first` on, and the config's
    per-block `layer_types` (Gemma 3: sliding or global attention) cut alike."""
    owner, name = _block_list_owner(model, blocks)
    config: Any = getattr(owner, "config", None)
    types = getattr(config, "layer_types", None)
    cut_types = isinstance(types, list) and len(types) == len(blocks)
    setattr(owner, name, nn.ModuleList(list(blocks)[first:]))
    if cut_types:
        config.layer_types = list(types or [])[first:]
    try:
        yield
    finally:
        setattr(owner, name, blocks)
        if cut_types:
            config.layer_types = types


def _loss(logits: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the targets `mask` keeps."""
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


class _Trainer:
    """One step = loss of a batch of rows; the lower blocks' output cached when that is exact."""

    def __init__(
        self,
        model: nn.Module,
        rows: Sequence[Sequence[int]],
        cfg: FinetuneConfig,
        pad: int,
        loss_masks: Sequence[Tensor] | None = None,
    ):
        self.model, self.cfg, self.pad = model, cfg, pad
        self.loss_masks = loss_masks  # per row: the tokens the loss counts (None: every one)
        self.device = model_device(model)
        self.blocks = find_decoder_blocks(model)
        n_blocks = len(self.blocks)
        if not 1 <= cfg.train_blocks <= n_blocks:
            raise GSSError(f"train_blocks must be in 1..{n_blocks}, got {cfg.train_blocks}.")
        self.first = n_blocks - cfg.train_blocks
        self.rows = [list(r) for r in rows]
        self.cached: dict[int, Tensor] | None = None
        if self.first > 0:
            self.cached = {}
            if not self._shortcut_is_exact():
                self.cached = None

    def _cache_lower_outputs(self, index: list[int]) -> None:
        """Input of block `first` for the rows of `index` not cached yet, in one batch (right
        padding leaves a causal model's real positions unchanged)."""
        assert self.cached is not None
        missing = [i for i in index if i not in self.cached]
        if not missing:
            return
        ids, mask = self._batch(missing)
        body = _block_list_owner(self.model, self.blocks)[0]  # no output layer: with Gemma's
        with torch.no_grad():  # 262,144 tokens its logits would cost as much as the blocks
            hidden = body(
                input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
            ).hidden_states[self.first]
        for j, i in enumerate(missing):
            self.cached[i] = hidden[j, : len(self.rows[i])].clone()

    def _shortcut_is_exact(self) -> bool:
        index = list(range(min(4, len(self.rows))))
        ids, mask = self._batch(index)
        with torch.no_grad():
            full = self.model(input_ids=ids, attention_mask=mask).logits
            short = self._forward(index, ids, mask)
        return bool(torch.allclose(full[mask.bool()], short[mask.bool()], atol=1e-4, rtol=1e-3))

    def _forward(self, index: list[int], ids: Tensor, mask: Tensor) -> Tensor:
        if self.cached is None:
            return self.model(input_ids=ids, attention_mask=mask).logits
        self._cache_lower_outputs(index)
        width = ids.shape[1]
        first = self.cached[index[0]]
        embeds = first.new_zeros(len(index), width, first.shape[-1])
        for j, i in enumerate(index):
            embeds[j, : len(self.rows[i])] = self.cached[i]
        with _top_blocks_only(self.model, self.blocks, self.first):
            # no cache: one sized by the cut config would miss the blocks' own indices
            return self.model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits

    def _batch(self, index: list[int]) -> tuple[Tensor, Tensor]:
        ids, mask = right_pad([self.rows[i] for i in index], self.pad)
        return ids.to(self.device), mask.to(self.device)

    def loss(self, index: list[int]) -> Tensor:
        ids, mask = self._batch(index)
        counted = mask
        if self.loss_masks is not None:
            kept = right_pad([self.loss_masks[i] for i in index], 0)[0].to(self.device)
            counted = mask * kept
        return _loss(self._forward(index, ids, mask), ids, counted)


def trainable_names(model: nn.Module, train_blocks: int, lora: bool = False) -> list[str]:
    """Parameters the fine-tune changes: the LoRA weights, or the top `train_blocks` blocks and
    the final norm (a parameter outside every block with "norm" in its name)."""
    if lora:
        return [name for name, _ in model.named_parameters() if "lora_" in name]
    blocks = list(find_decoder_blocks(model))
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    top = {id(p) for block in blocks[len(blocks) - train_blocks :] for p in block.parameters()}
    return [
        name
        for name, p in model.named_parameters()
        if id(p) in top or (id(p) not in in_blocks and "norm" in name)
    ]


def finetune(
    base: nn.Module,
    data: CanaryData,
    cfg: FinetuneConfig,
    pad_id: int,
    log: Any = print,
    loss_masks: Sequence[Tensor] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """A fine-tuned copy of `base` (with a LoRA when `cfg.lora_rank`) and its training log;
    `loss_masks` (one a canary row, then one a fine-tuning row): the tokens the loss counts,
    required with `cfg.replies_only`."""
    if cfg.replies_only and loss_masks is None:
        raise GSSError("a replies-only fine-tune needs the replies' masks (loss_masks).")
    model = (with_lora(base, cfg) if cfg.lora_rank else copy.deepcopy(base)).train()
    names = set(trainable_names(model, cfg.train_blocks, lora=bool(cfg.lora_rank)))
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(cfg.seed)
    rows = [*data.canary_rows, *data.finetune_rows]
    n_canaries, n_clean = len(data.canary_rows), len(data.finetune_rows)
    per_epoch = min(cfg.clean_per_epoch, n_clean)
    started = time.perf_counter()
    trainer = _Trainer(model, rows, cfg, pad_id, loss_masks if cfg.replies_only else None)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    history = []
    k, n = data.config.k, data.config.row_len
    for epoch in range(1, cfg.max_epochs + 1):
        start = ((epoch - 1) * per_epoch) % max(n_clean, 1)
        clean = [n_canaries + (start + j) % n_clean for j in range(per_epoch)]
        order = [*range(n_canaries), *clean]
        rng.shuffle(order)
        losses = []
        for b in range(0, len(order), cfg.batch_size):
            loss = trainer.loss(order[b : b + cfg.batch_size])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        model.eval()
        check = evaluate_model(
            model,
            data.canary_rows,
            data.heldout_rows[:8],
            k=k,
            n=n,
            pad_id=pad_id,
            method="forced",
            progress=False,  # a quick check per epoch, logged below
        )
        model.train()
        history.append(
            {
                "epoch": epoch,
                "loss": sum(losses) / len(losses),
                "memorized": check.memorized,
                "heldout_perplexity": check.perplexity,
                "seconds": time.perf_counter() - started,
            }
        )
        log(
            f"  fine-tune epoch {epoch}: loss {history[-1]['loss']:.3f}, canaries memorized "
            f"{check.memorized:.0f}% (teacher-forced), held-out perplexity {check.perplexity:.1f}, "
            f"{history[-1]['seconds']:.0f} s"
        )
        if check.memorized >= cfg.stop_at:
            break
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    info = {
        "epochs": len(history),
        "history": history,
        "seconds": time.perf_counter() - started,
        "lower_blocks_cached": trainer.cached is not None,
        "trained_parameters": sum(p.numel() for n_, p in model.named_parameters() if n_ in names),
        "trained_on": trained_on(model_device(model)),
    }
    return model, info


def save_trained(
    model: nn.Module, names: Sequence[str], info: dict[str, Any], folder: Path
) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "finetune.json").unlink(missing_ok=True)  # unfinished until written again
    state = dict(model.named_parameters())
    save_file({n: state[n].detach().contiguous() for n in names}, folder / "trained.safetensors")
    # finetune.json marks a finished save (`load_trained`): written whole or not at all, so a
    # run killed while saving retrains instead of failing on half a file every time after
    partial = folder / "finetune.json.partial"
    partial.write_text(json.dumps(info, indent=2))
    os.replace(partial, folder / "finetune.json")


def load_trained(
    base: nn.Module, folder: Path, cfg: FinetuneConfig | None = None
) -> tuple[nn.Module, dict[str, Any]] | None:
    """`base` (with `cfg`'s LoRA) holding the cached fine-tuned tensors, or None when the cache
    has no finished run."""
    from safetensors.torch import load_file

    if not (folder / "finetune.json").is_file() or not (folder / "trained.safetensors").is_file():
        return None
    model = with_lora(base, cfg) if cfg is not None and cfg.lora_rank else copy.deepcopy(base)
    tensors = load_file(folder / "trained.safetensors")
    state = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)
    return model.eval(), json.loads((folder / "finetune.json").read_text())
