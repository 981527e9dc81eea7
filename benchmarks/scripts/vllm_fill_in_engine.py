"""The runner patch's slot fill timed inside a real vLLM engine (issue 40, point 5).

``vllm_fill_slots.py`` times the fill on a stand-in runner; on an H200 the host's call to the
runner's ``_model_forward`` still took ~0.04 ms longer with the artifact after the fill stopped
writing on steady decode steps (``results/serve-op-share-cuda-2``), where the stand-in said 6-7
us. This times ``gss.serving.vllm_plugin._fill_slots`` itself, every step, inside vLLM's own
runner (the CPU build here: its runner inherits ``_model_forward`` from the GPU runner), on a
tiny Llama with one artifact steering every request: one request, then 16 at once, greedy.
Run in the vLLM environment; the engine runs in this process.

    .venv-vllm/bin/python benchmarks/scripts/vllm_fill_in_engine.py --out results/serve-fill-slots
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner in this process, to time it
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.vllm's tiny model

from gss.serving import vllm_plugin  # noqa: E402


def quantiles(seconds: list[float]) -> dict[str, float]:
    s = sorted(seconds)
    return {
        "median_us": 1e6 * statistics.median(s),
        "q10_us": 1e6 * s[len(s) // 10],
        "q90_us": 1e6 * s[9 * len(s) // 10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for in-engine-MODE.json")
    parser.add_argument("--work", default="/tmp/gss-fill-in-engine", help="model and artifact")
    parser.add_argument("--tokens", type=int, default=150, help="greedy tokens per request")
    parser.add_argument("--compiled", action="store_true", help="torch.compile (default eager)")
    args = parser.parse_args()

    vllm_plugin.register()
    import torch
    from tests.vllm.test_vllm_plugin import VOCAB, tiny_model
    from vllm.v1.worker import gpu_model_runner

    import gss
    import vllm
    from vllm import LLM, SamplingParams

    work = Path(args.work)
    if not (work / "artifact").exists():
        model, reference = tiny_model(0), tiny_model(1)
        model.save_pretrained(work / "model")
        ids = torch.randint(3, VOCAB, (48, 32), generator=torch.Generator().manual_seed(0))
        art = gss.calibrate(model, reference, ids, layer=1, rank=2, progress=False)
        art.save_pretrained(work / "artifact")
    llm = LLM(
        str(work / "model"),
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=not args.compiled,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        seed=0,
        additional_config={"gss_artifacts": {"a": str(work / "artifact")}},
    )
    fills: list[float] = []
    forwards: list[float] = []
    fill = vllm_plugin._fill_slots

    def timed_fill(runner: Any) -> None:  # the patched _model_forward calls it by this name
        start = time.perf_counter()
        fill(runner)
        fills.append(time.perf_counter() - start)

    vllm_plugin._fill_slots = timed_fill
    runner_cls = gpu_model_runner.GPUModelRunner
    forward = runner_cls._model_forward

    def timed_forward(self: Any, *a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return forward(self, *a, **k)
        finally:
            forwards.append(time.perf_counter() - start)

    runner_cls._model_forward = timed_forward
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=args.tokens,
        ignore_eos=True,
        detokenize=False,
        extra_args={"gss": "a"},
    )
    prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(16)]
    rows: list[dict[str, Any]] = []
    for n in (1, 16):
        fills.clear()
        forwards.clear()
        llm.generate(prompts[:n], [sp] * n, use_tqdm=False)
        row: dict[str, Any] = {"sequences": n, "steps": len(fills), "fill": quantiles(fills)}
        row["forward_ms_median"] = 1e3 * statistics.median(forwards)
        print(
            f"{n} sequence(s): fill median {row['fill']['median_us']:.1f} us "
            f"[{row['fill']['q10_us']:.1f}-{row['fill']['q90_us']:.1f}], {len(fills)} steps; "
            f"forward median {row['forward_ms_median']:.3f} ms",
            flush=True,
        )
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "benchmarks/scripts/vllm_fill_in_engine.py " + " ".join(sys.argv[1:]),
        "mode": "compiled" if args.compiled else "eager",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "rows": rows,
    }
    (out / f"in-engine-{result['mode']}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
