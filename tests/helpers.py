"""Tiny randomly initialised models and token rows built in the test: no downloads, seconds to
run. Imported by the tests (``from .helpers import tiny_model``); the fixtures are in
``conftest.py``."""

from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Tiny models gain nothing from a second thread, and two OpenMP threads next to any other busy
# process slow every op to a scheduler time slice (measured: 37x slower training steps).
torch.set_num_threads(1)

VOCAB = 48
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# Qwen3 arrived in transformers 4.51; the package supports older ones (pyproject's floor)
HAS_QWEN3 = hasattr(transformers, "Qwen3ForCausalLM")
# opt: embeddings half as wide as the blocks (projected in and out), as in OPT-350m
ARCHITECTURES = (
    "gpt2",
    "gpt_neox",
    "llama",
    "qwen2",
    "mistral",
    "opt",
    *(["qwen3"] if HAS_QWEN3 else []),
)


def tiny_model(arch: str, seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = VOCAB):
    """A tiny causal LM of the given architecture with random weights, in eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, **TOKENS)
    llama_like = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **common,
    )
    if arch == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(n_positions=128, n_embd=hidden, n_layer=layers, n_head=4, **common)
        )
    elif arch == "gpt_neox":
        model = GPTNeoXForCausalLM(
            GPTNeoXConfig(
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                max_position_embeddings=128,
                **common,
            )
        )
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**llama_like))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**llama_like))
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=hidden // 4, **llama_like)
        model = transformers.Qwen3ForCausalLM(config)
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **llama_like))
    elif arch == "opt":
        config = transformers.OPTConfig(
            hidden_size=hidden,
            word_embed_proj_dim=hidden // 2,
            ffn_dim=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=128,
            **common,
        )
        model = transformers.OPTForCausalLM(config)
    else:
        raise ValueError(arch)
    return model.eval()


def random_ids(n: int, length: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen)


def calibrated_llama(layers: int = 2):
    """A tiny Llama and a rank-2 steer at block 1, strong enough to change greedy choices."""
    import gss

    model = tiny_model("llama", seed=3, layers=layers)
    ref = tiny_model("llama", seed=11, layers=layers)
    art = gss.calibrate(model, ref, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False)
    return model, art.with_options(delta=25.0)


def general_rows(n: int, length: int, gen: torch.Generator, vocab: int) -> torch.Tensor:
    """Rows that follow a learnable rule: x_{t+1} = x_t + step (mod the usable vocab)."""
    start = torch.randint(0, vocab - 3, (n, 1), generator=gen)
    step = torch.randint(1, 4, (n, 1), generator=gen)
    return 3 + (start + step * torch.arange(length)) % (vocab - 3)


def train(model, rows: torch.Tensor, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, rows.shape[0], (32,), generator=gen)
        loss = model(input_ids=rows[idx], labels=rows[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def at_block(art, layer: int):
    """``art``'s tensors as a steer of another block (a stack holds one steer per block)."""
    import dataclasses

    return dataclasses.replace(art, config=art.config.replace(layer=layer))


def sealed(raw: dict) -> dict:
    """An artifact's config file edited by hand and sealed again (its content checksum
    recomputed), as a forger would: for tests of what gss checks beyond the checksum."""
    from gss.artifact.steering_artifact import content_sha256

    if "content_sha256" in raw:
        raw["content_sha256"] = content_sha256(raw)
    return raw


WORDS = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(44)]


def word_tokenizer(words=WORDS):
    """A word-level tokenizer over ``words`` (ids in their order), built here: no download."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_input_names=["input_ids", "attention_mask"],  # as decoder-only tokenizers have
    )
