"""The TinyMem model: a small GPT-2, trained as a lean module and handed out as HF GPT-2.

`LeanGPT2` computes exactly what `transformers.GPT2LMHeadModel` computes for a GPT-2 config with
pre-LayerNorm blocks, learned absolute positions, tied embeddings, no dropout and right padding
only (the tests check equal logits and loss), with fewer Python layers in between. Its parameter
names and layouts are the HF ones (Conv1D weights stored as ``(in, out)``), so `to_hf` / `from_hf`
copy the state dict unchanged.

Measured training speed (fwd + bwd + AdamW, 4 layers, d 128, 1 thread, batch 64 x 112 tokens, on
the project's 2-core AMD EPYC CPU): lean 5.3 k tokens/s, HF GPT-2 5.1 k, lean under
``torch.compile`` 4.6-5.4 k (after ~40 s of compiling). 70 % of the time is in the matmuls and
22 % in attention, so the model is compute-bound and the gain is small; d 64 runs at 13-14 k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

__all__ = ["LeanGPT2", "ModelConfig", "from_hf", "gpt2_config", "new_model", "to_hf"]


@dataclass(frozen=True)
class ModelConfig:
    """Size of the TinyMem GPT-2 (the paper's 4-layer model by default).

    `init_scale` gives ``initializer_range = init_scale / sqrt(n_embd)`` (TinyMem: 0.8/sqrt(128)).
    `vocab_size` and `n_positions` are filled in from the data by `train.get_models`.
    """

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    activation: str = "relu"
    init_scale: float = 0.8
    vocab_size: int = 14
    n_positions: int = 128
    pad_id: int = 13
    bos_id: int = 10
    eos_id: int = 11


def gpt2_config(cfg: ModelConfig) -> GPT2Config:
    """The HF config of the model described by `cfg` (all dropouts 0, tied embeddings)."""
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.n_positions,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=4 * cfg.n_embd,
        activation_function=cfg.activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        layer_norm_epsilon=1e-5,
        initializer_range=cfg.init_scale / math.sqrt(cfg.n_embd),
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id,
        tie_word_embeddings=True,
        use_cache=True,
    )


_ACTIVATIONS = {
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class _Conv1D(nn.Module):
    """HF's GPT-2 linear layer: weight stored as (in, out)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], out.shape[-1])


class _Attention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = _Conv1D(d, 3 * d)
        self.c_proj = _Conv1D(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class _MLP(nn.Module):
    def __init__(self, d: int, act: str) -> None:
        super().__init__()
        self.c_fc = _Conv1D(d, 4 * d)
        self.c_proj = _Conv1D(4 * d, d)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int, act: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = _Attention(d, n_head)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = _MLP(d, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.n_embd
        self.wte = nn.Embedding(cfg.vocab_size, d)
        self.wpe = nn.Embedding(cfg.n_positions, d)
        self.h = nn.ModuleList(_Block(d, cfg.n_head, cfg.activation) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)


class LeanGPT2(nn.Module):
    """GPT-2 LM with HF parameter names; causal, no attention mask (right padding only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = _Body(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` for `input_ids` ``(batch, seq)``."""
        tr = self.transformer
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = tr.wte(input_ids) + tr.wpe(pos)
        for block in tr.h:
            x = block(x)
        return F.linear(tr.ln_f(x), tr.wte.weight)

    def loss(self, input_ids: torch.Tensor, ignore_id: int) -> torch.Tensor:
        """Mean next-token cross-entropy over targets that are not `ignore_id` (the PAD id)."""
        logits = self(input_ids[:, :-1])
        targets = input_ids[:, 1:]
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_id
        )


def new_model(cfg: ModelConfig, seed: int) -> LeanGPT2:
    """A freshly initialised model, with HF GPT-2's own initialisation for `seed`.

    The weights are drawn by `GPT2LMHeadModel` itself (normal(0, initializer_range), c_proj
    scaled by 1/sqrt(2 n_layer), zero biases, unit LayerNorms) and copied over.
    """
    torch.manual_seed(seed)
    return from_hf(GPT2LMHeadModel(gpt2_config(cfg)), cfg)


def _body_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.startswith("transformer.")}


def to_hf(model: LeanGPT2) -> GPT2LMHeadModel:
    """An HF `GPT2LMHeadModel` (eval mode) with exactly the weights of `model`."""
    hf = GPT2LMHeadModel(gpt2_config(model.cfg))
    _copy_body(_body_state(model), hf)
    return hf.eval()


def from_hf(hf: GPT2LMHeadModel, cfg: ModelConfig) -> LeanGPT2:
    """A `LeanGPT2` with exactly the weights of `hf` (which must match `cfg`)."""
    lean = LeanGPT2(cfg)
    _copy_body(_body_state(hf), lean)
    return lean


def _copy_body(state: dict[str, torch.Tensor], target: nn.Module) -> None:
    own = _body_state(target)
    extra = set(state) - set(own)
    missing = {k for k in set(own) - set(state) if not k.endswith(".attn.bias")}
    if extra or missing:
        raise ValueError(f"state dicts differ: extra {sorted(extra)}, missing {sorted(missing)}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)
    if isinstance(target, PreTrainedModel):  # the lean model has no tied copy to refresh
        target.tie_weights()
