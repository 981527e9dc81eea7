"""Tiny models for the evaluate tests: a lookup-table LM whose outputs are fully controlled, and
random HF GPT-2s built from configs (nothing downloaded)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel


class TableLM(nn.Module):
    """A causal "LM" that predicts the next token by looking its whole context up in a table.

    It speaks the HF forward protocol the metrics use (input_ids, attention_mask, position_ids,
    past_key_values, use_cache -> .logits, .past_key_values). Masked positions are left out of
    the context, so a metric that mishandles left padding gets wrong contexts and wrong answers.
    Contexts not in the table predict `default`.
    """

    def __init__(self, paths: list[list[int]], vocab: int, default: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.vocab = vocab
        self.default = default
        self.table: dict[tuple[int, ...], int] = {}
        for path in paths:
            for t in range(1, len(path)):
                self.table[tuple(path[:t])] = path[t]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: list[list[int]] | None = None,
        use_cache: bool = False,
    ) -> SimpleNamespace:
        b, n = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, n, dtype=torch.long)
        new_mask = attention_mask[:, -n:]
        contexts = [list(c) for c in past_key_values] if past_key_values else [[] for _ in range(b)]
        logits = torch.zeros(b, n, self.vocab)
        for i in range(b):
            for t in range(n):
                if new_mask[i, t]:
                    contexts[i].append(int(input_ids[i, t]))
                    nxt = self.table.get(tuple(contexts[i]), self.default)
                else:
                    nxt = self.default
                logits[i, t, nxt] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=contexts if use_cache else None)


@pytest.fixture
def table_lm():
    return TableLM


def tiny_gpt2(vocab: int = 16, seed: int = 0, n_positions: int = 64) -> GPT2LMHeadModel:
    """A random 2-layer GPT-2 with a large init so that its greedy outputs vary with the input."""
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=n_positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.5,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture
def gpt2_factory():
    return tiny_gpt2
