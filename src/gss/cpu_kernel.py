"""The fused gated steer as one C++ function, for float32 decode steps on a CPU (opt-in).

On a CPU each PyTorch op inside a decode step costs tens of microseconds (its dispatch and
kernel run from caches the model's own ops have just evicted), and the steer's three ops
(two multiply-adds and a hardshrink) are then 1-2% of a small model's step. This function does
the whole steer in one call: per row, the K probe responses, the hard gate, and the rows of
the steer whose gate opened. It is built from the source below by
``torch.utils.cpp_extension`` the first time it is asked for (about 30 s; it needs a C++
compiler and ``ninja``) and cached under ``$GSS_KERNEL_DIR`` or ``~/.cache/gss/kernels``.

Only small inputs (decode steps: at most ``SMALL_ROWS`` rows) and inputs that need no
gradient take the loop; anything else runs the same three ATen ops as the Python fast path,
called from C++, so a prompt pass or a backward stays exactly as without it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import GSSError

SMALL_ROWS = 64  # rows (batch x positions) up to which the loop beats the ATen ops

_SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>

constexpr int64_t SMALL_ROWS = @SMALL_ROWS@;

// out = h + shrink(h @ probe_t + neg_offset) @ neg_steer, shrink = hardshrink at 1 (hard)
// or nothing (ungated): what GatedSteer's fused path computes with three ATen ops. probe is
// probe_t's rows, (k, d) contiguous, for the loop's dot products.
torch::Tensor steer(const torch::Tensor& h, const torch::Tensor& probe_t,
                    const torch::Tensor& probe, const torch::Tensor& neg_offset,
                    const torch::Tensor& neg_steer, bool hard) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == torch::kFloat32,
              "gss CPU kernel: float32 CPU hidden states only");
  const int64_t d = probe_t.size(0), k = probe_t.size(1);
  TORCH_CHECK(h.dim() >= 1 && h.size(-1) == d, "gss CPU kernel: hidden size mismatch");
  const int64_t rows = h.numel() / d;
  if (rows > SMALL_ROWS || (torch::GradMode::is_enabled() && h.requires_grad())) {
    auto flat = h.reshape({-1, d});
    auto s = at::addmm(neg_offset, flat, probe_t);
    if (hard) s = at::hardshrink(s, 1.0);
    return at::addmm(flat, s, neg_steer).view(h.sizes());
  }
  auto hc = h.contiguous();
  auto out = torch::empty_like(hc);
  const float* x0 = hc.data_ptr<float>();
  const float* p = probe.data_ptr<float>();
  const float* b = neg_offset.data_ptr<float>();
  const float* n = neg_steer.data_ptr<float>();  // (k, d), contiguous
  float* y0 = out.data_ptr<float>();
  constexpr int64_t W = 8;  // independent partial sums: the compiler vectorizes the dot
  const int64_t body = d - d % W;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = x0 + r * d;
    float* y = y0 + r * d;
    std::copy(x, x + d, y);
    for (int64_t j = 0; j < k; ++j) {
      const float* pj = p + j * d;
      float acc[W] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < body; i += W)
        for (int64_t u = 0; u < W; ++u) acc[u] += x[i + u] * pj[i + u];
      float sj = b[j];
      for (int64_t u = 0; u < W; ++u) sj += acc[u];
      for (int64_t i = body; i < d; ++i) sj += x[i] * pj[i];
      if (hard && sj >= -1.0f && sj <= 1.0f) continue;  // a closed gate: no correction at all
      const float* nj = n + j * d;
      for (int64_t i = 0; i < d; ++i) y[i] += sj * nj[i];
    }
  }
  return out;
}
""".replace("@SMALL_ROWS@", str(SMALL_ROWS))

_loaded: dict[str, Callable[..., Tensor]] = {}


def _name() -> str:
    """The build's name: the source, torch and Python versions, so an upgrade rebuilds."""
    key = f"{_SOURCE}|{torch.__version__}|{sys.version_info[:2]}".encode()
    return "gss_cpu_steer_" + hashlib.sha256(key).hexdigest()[:12]


def kernel_dir() -> Path:
    """``$GSS_KERNEL_DIR`` if set, else ``~/.cache/gss/kernels``."""
    env = os.environ.get("GSS_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "gss" / "kernels"


def load() -> Callable[..., Tensor]:
    """The compiled ``steer(h, probe_t, probe, neg_offset, neg_steer, hard)``, built on first
    use."""
    name = _name()
    fn = _loaded.get(name)
    if fn is not None:
        return fn
    build = kernel_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob(f"{name}*.so")):
        print(
            f"gss: building the CPU steer kernel in {build} (once per torch version, ~30 s)",
            file=sys.stderr,
            flush=True,
        )
    path = os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load_inline

        if shutil.which("ninja") is None:  # the PyPI wheel's binary, in an unactivated venv
            try:
                import ninja

                os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{path}"
            except ImportError:
                pass  # load_inline says that ninja is missing
        module: Any = load_inline(
            name,
            cpp_sources=_SOURCE,
            functions=["steer"],
            extra_cflags=["-O3"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as err:
        raise GSSError(
            f"could not build gss's CPU steer kernel ({type(err).__name__}: "
            f"{str(err).strip()[-500:]}). It needs a C++ compiler (g++ or clang) and ninja "
            "(`pip install ninja`); or attach without cpu_kernel=True, which runs the same "
            "steer as three PyTorch ops."
        ) from err
    finally:
        os.environ["PATH"] = path
    fn = module.steer
    _loaded[name] = fn
    return fn
