"""Where do an unsteered request's log-probs move on CUDA? (README.md beside this file)

On the H200 (vLLM 0.26.0, torch.compile + CUDA graphs), tests/vllm's mixed batch gave every
request the tokens transformers gives, but one unsteered request's log-prob at one token
differed from the engine without the plugin by one float32 ulp. This runs the same
tiny model and prompts through four engines, one after another, and compares each with the
first, request by request:

* ``plain-a``, ``plain-b``: no plugin, twice: is vLLM itself reproducible from one engine to
  the next?
* ``plugin-unsteered``: the plugin serving the artifact, no request steered: does the steer's
  place in the compiled graph alone move them?
* ``plugin-mixed``: tests/vllm's mixed batch: do the steered neighbours move them?

``--v2``: every engine through vLLM's Model Runner V2 (on the H200, 2026-11-28, V2 eager gave
the mixed batch's unsteered requests log-probs up to 5.2e-5 off the engine without the plugin).

    PYTHONPATH=/tmp/site python3 benchmarks/vllm_gpu/repeat.py [--eager] [--v2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.vllm.test_vllm_plugin import (  # noqa: E402
    PROMPTS,
    STEER_NAME,
    logprob_differences,
    run_engine,
    save_tiny,
)


def compare(base: dict[str, Any], other: dict[str, Any], which: list[int]) -> dict[str, Any]:
    diffs = [abs(d) for *_, d in logprob_differences(base, other, which)]
    return {
        "requests": which,
        "tokens_equal": all(base["tokens"][i] == other["tokens"][i] for i in which),
        "logprobs_compared": sum(len(base["logprobs"][i]) for i in which),
        "logprobs_differ": len(diffs),
        "max_abs_difference": max(diffs, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    parser.add_argument("--v2", action="store_true", help="through Model Runner V2 (default: V1)")
    parser.add_argument("--out", default=".", help="where repeat-<mode>[-v2].json goes")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gss-repeat-"))
    _, prompts = save_tiny(root, {"artifact": 1})
    nobody: list[str | None] = [None] * len(prompts)
    mixed = [STEER_NAME if on else None for _, on in PROMPTS]
    options = {"enforce_eager": args.eager, "runner_v2": args.v2}
    runs = {
        "plain-a": run_engine(root, prompts, nobody, plugin=False, tag="a", **options),
        "plain-b": run_engine(root, prompts, nobody, plugin=False, tag="b", **options),
        "plugin-unsteered": run_engine(root, prompts, nobody, plugin=True, tag="u", **options),
        "plugin-mixed": run_engine(root, prompts, mixed, plugin=True, tag="m", **options),
    }
    everyone = list(range(len(prompts)))
    unsteered = [i for i, (_, on) in enumerate(PROMPTS) if not on]
    base = runs["plain-a"]
    found = {
        "mode": ("eager" if args.eager else "compiled") + ("-v2" if args.v2 else ""),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "plain-b vs plain-a": compare(base, runs["plain-b"], everyone),
        "plugin-unsteered vs plain-a": compare(base, runs["plugin-unsteered"], everyone),
        "plugin-mixed vs plain-a (its unsteered requests)": compare(
            base, runs["plugin-mixed"], unsteered
        ),
    }
    text = json.dumps(found, indent=1)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"repeat-{found['mode']}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
