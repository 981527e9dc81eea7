"""What the vLLM plugin's steered layer runs per step, counted on this CPU (issue 40, point 5).

Inside CUDA graphs every kernel of a step costs the device a launch slot of a few microseconds,
whatever its size, so at a small model's decode step the number of kernels the steer adds is
its cost. This compiles (inductor, as vLLM does) a stand-in of a steered vLLM layer followed by
the next layer's fused add-RMSNorm, on a tiny Llama's artifact, and lists the kernels inductor
generates (``run_and_get_code``), the calls it makes outside them (the block's matmul, the
opaque op ``gss::vllm_steer``) and the aten calls the op makes inside (torch's profiler). On
this CPU inductor writes C++ kernels where on CUDA it writes Triton ones; which nodes fuse is
mostly decided by its scheduler before either backend, so the count should carry over to a
CUDA graph (not checked on a GPU). The op's own aten calls run on the device as written, one
kernel each (cuBLAS may take two for an ``addmm``).

    .venv/bin/python benchmarks/scripts/vllm_op_kernels.py --out results/serve-op-kernels

``before-c3c51c1.json`` there is the same count on the code before the op stopped selecting
the rows itself at a layer with one artifact (c3c51c1); ``before-residual-in-op.json`` before
the op took hidden and residual apart and added them itself (the layer's add was a kernel of
inductor's of its own). On CUDA the op runs one Triton kernel instead of its aten calls
(``gss/serving/triton_steer.py``), which this CPU count does not see.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch._inductor.utils import run_and_get_code

import gss
from gss.serving import vllm_op
from gss_bench.perf.common import QUICK, tiny_model

LAYER = 1


SIZES = dataclasses.replace(QUICK, hidden=32, layers=3, vocab=64)  # a tiny Llama


class Block(torch.nn.Module):
    """A vLLM Llama layer's tail: its down projection, and (hidden, residual) handed on."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.down = torch.nn.Linear(d, d)

    def forward(self, h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.down(h), r


def next_norm(h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next layer's fused add-RMSNorm (vLLM's, as torch ops)."""
    r = h + r
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6), r


VIEWS = {"aten::view", "aten::view_as", "aten::reshape", "aten::unsqueeze", "aten::slice"}


def attach(block: torch.nn.Module) -> None:
    """Steer ``block`` as the plugin's install does."""
    block.__class__ = vllm_op.steered_class(type(block))
    block._gss_layer = LAYER  # type: ignore[assignment]


def count(tokens: int) -> dict[str, Any]:
    model, reference = tiny_model(SIZES, 0), tiny_model(SIZES, 1)
    ids = torch.randint(0, SIZES.vocab, (32, 16), generator=torch.Generator().manual_seed(0))
    art = gss.calibrate(model, reference, ids, layer=LAYER, rank=2, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        art.save_pretrained(f"{tmp}/a")
        state = vllm_op.State()
        state.load({"a": f"{tmp}/a"})
    vllm_op.STATE = state
    d = SIZES.hidden
    state.prepare(torch.device("cpu"), torch.float32, 64)
    block = Block(d)
    attach(block)

    def step(h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return next_norm(*block(h, r))

    h, r = torch.randn(tokens, d), torch.randn(tokens, d)
    assert state.slots is not None
    state.slots[:tokens] = torch.tensor([0, -1], dtype=torch.int32).repeat(tokens)[:tokens]
    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, h, r)
        call = "\n".join(codes).split("def call(", 1)[1]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            vllm_op.steered_block_output(h, LAYER, r)  # as the steered layer calls it
    inside = [e.name for e in prof.events() if _top_aten(e)]
    return {
        "tokens": tokens,
        "inductor_kernels": re.findall(r"^\s+(cpp_fused_\w+)\(", call, re.M),
        "calls_outside_kernels": re.findall(
            r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.[\w.]+)\(", call, re.M
        ),
        "aten_calls_inside_the_op": inside,
        "kernels_inside_the_op": [c for c in inside if c not in VIEWS],
    }


def _top_aten(event: Any) -> bool:
    """An aten call made by the op's Python itself, not by another aten call."""
    parent = event.cpu_parent
    return event.name.startswith("aten::") and (
        parent is None or not parent.name.startswith("aten::")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    result = count(args.tokens)
    result["torch"] = torch.__version__
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# The steered layer's kernels, compiled (CPU, inductor)",
        "",
        f"`benchmarks/scripts/vllm_op_kernels.py --tokens {args.tokens}`, "
        f"torch {torch.__version__}: a steered layer's tail and the next layer's add-RMSNorm, "
        "compiled; one artifact.",
        "",
        f"- inductor's kernels ({len(result['inductor_kernels'])}): "
        + ", ".join(f"`{k}`" for k in result["inductor_kernels"]),
        "- calls outside them: " + ", ".join(f"`{c}`" for c in result["calls_outside_kernels"]),
        f"- aten calls inside the op, views left out ({len(result['kernels_inside_the_op'])}): "
        + ", ".join(f"`{c}`" for c in result["kernels_inside_the_op"]),
    ]
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
