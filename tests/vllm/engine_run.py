"""Greedy generation with vLLM in a process of its own, for test_vllm_plugin.py.

``python engine_run.py job.json out.json``. The plugin is registered at the top level: vLLM
starts its engine and workers with multiprocessing's spawn, which imports this script again
in each of them (as ``__mp_main__``), so they are patched too even without the
``vllm.general_plugins`` entry point installed. With it installed, vLLM calls `register`
itself; calling it twice is harmless. It does nothing unless GSS_VLLM_ARTIFACTS is set.
"""

from __future__ import annotations

import json
import os
import sys
import time

from gss.serving import vllm_plugin

INTERPRET_ENV = "GSS_TEST_TRITON_INTERPRET"
"""Set to 1 (test_vllm_plugin.py does, for Model Runner V2 on a machine without CUDA): vLLM's
Triton kernels run in Triton's interpreter, on the CPU."""


def run_triton_kernels_on_the_cpu() -> None:
    """Model Runner V2 prepares each step's inputs with Triton kernels, and the CPU build of
    vLLM enables it only where Triton has a CPU backend (triton-cpu, not on PyPI). Triton's own
    interpreter (``TRITON_INTERPRET=1``) runs the same kernels on CPU tensors: vLLM is told a
    CPU backend exists while it checks (``triton.backends.backends["cpu"]``, read once, when
    ``vllm.triton_utils`` is imported), and every kernel launch goes to the interpreter. The
    entry is removed again, or torch's inductor would take it for a Triton it can compile
    for. Test harness only: the plugin is unchanged."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends

    class Driver:
        @staticmethod
        def is_active() -> bool:
            return True

    backends = triton.backends.backends
    backends["cpu"] = triton.backends.Backend(
        compiler=next(iter(backends.values())).compiler, driver=Driver
    )
    try:
        import vllm.triton_utils  # noqa: F401  (HAS_TRITON, from the backends above)
    finally:
        del backends["cpu"]


if __name__ in ("__main__", "__mp_main__"):  # run, or re-imported by a spawned process
    if os.environ.get(INTERPRET_ENV) == "1":  # before vLLM is imported
        run_triton_kernels_on_the_cpu()
    vllm_plugin.register()


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        job["model"],
        dtype=job.get("dtype", "float32"),
        skip_tokenizer_init=True,
        enforce_eager=job.get("enforce_eager", True),
        max_model_len=job.get("max_model_len", 128),
        max_num_batched_tokens=job.get("max_num_batched_tokens", 128),
        max_num_seqs=job.get("max_num_seqs", 16),
        enable_chunked_prefill=True,
        enable_prefix_caching=job.get("prefix_caching", False),
        block_size=job.get("block_size"),
        seed=0,
        disable_log_stats=not job.get("metrics", False),
        **job.get("engine_args", {}),  # e.g. speculative_config, tensor_parallel_size
    )
    started = time.perf_counter() - start
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=job["max_tokens"],
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            extra_args={vllm_plugin.EXTRA_ARG: name} if name else None,
        )
        for name in job["artifacts"]
    ]
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    loras = None
    if job.get("loras"):  # per request: a LoRA adapter's directory, or None for the base model
        from vllm.lora.request import LoRARequest

        loras = [LoRARequest("adapter", 1, path) if path else None for path in job["loras"]]
    if job.get("warm_up_unsteered"):  # fill the prefix cache with the unsteered prompts' KV
        plain = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        llm.generate(prompts, [plain] * len(prompts), use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    result = {
        "started_s": started,
        "cached_tokens": [o.num_cached_tokens for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [
            [
                lp[t].logprob
                for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ]
            for o in outputs
        ],
    }
    parallel = llm.llm_engine.vllm_config.parallel_config
    result["parallel"] = {
        "tensor": parallel.tensor_parallel_size,
        "pipeline": parallel.pipeline_parallel_size,
    }
    if job.get("metrics"):  # counters, e.g. vllm:spec_decode_num_draft_tokens
        result["metrics"] = {
            m.name: m.value for m in llm.get_metrics() if isinstance(getattr(m, "value", None), int)
        }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
