"""vLLM's CUDA build on a tiny random Llama in bfloat16 (head_dim 128: FlashAttention 3 on
Hopper), offline ``LLM.generate``, greedy; prints vLLM's tokens, transformers' (bf16 too, so
a few may differ) and the time. Run on the device after install_on_device.sh
(README.md beside this file):

    PYTHONPATH=/tmp/site python3 benchmarks/vllm_gpu/smoke.py [--compiled]
"""

from __future__ import annotations

import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
import transformers

MODEL = Path("/tmp/vllm-smoke/llama")
PROMPTS = [[1, *range(5 + 7 * i, 25 + 7 * i)] for i in range(4)]
MAX_TOKENS = 16


def make_model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(MODEL)
    return model


def main() -> None:
    from vllm import LLM, SamplingParams

    plugins = [p.value for p in entry_points(group="vllm.general_plugins")]
    print("vllm.general_plugins:", plugins)
    model = make_model()
    start = time.perf_counter()
    llm = LLM(
        str(MODEL),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager="--compiled" not in sys.argv,
        max_model_len=128,
        gpu_memory_utilization=0.3,
        seed=0,
    )
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    model = model.to("cuda", torch.bfloat16)
    same = 0
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt) :]
        same += ref.tolist() == tokens
        print("vllm", tokens, "\nhf  ", ref.tolist())
    print(f"engine start {started:.1f} s; {same}/{len(PROMPTS)} prompts equal to transformers")


if __name__ == "__main__":
    main()
