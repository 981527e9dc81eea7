"""The fused gated steer as one compiled C++ hook, for float32, bfloat16 and float16 decode
steps on a CPU (opt-in).

On a CPU each PyTorch op inside a decode step costs tens of microseconds (its dispatch and
kernel run from caches the model's own ops have just evicted), and even a call through
pybind11 costs several. This hook is one C function that Python calls directly with the
block's ``(module, args, output)``: it reads the output tensor, computes per row the K probe
responses, the hard gate and the rows of the steer whose gate opened, and returns the steered
copy. ``attach(..., cpu_kernel=True)`` calls it from inside the block's ``forward``
(``gss.steering.gated.SteeredForward``), so the only Python of gss on a decode step is that wrapper's
call. Inside
``generate`` on the benchmark's tiny model it took 10-17 us per batch-1 step where the
pybind11 function it replaced took 18-20 (``hook_seconds_in_generate_kernel`` in
``gss bench perf``, one run each).

It steers only what it was built for: a plain float32, bfloat16 or float16, contiguous CPU
tensor (or a tuple starting with one) of at most ``SMALL_ROWS`` rows of the calibrated
width, needing no gradient, outside tracing and torch function or dispatch modes. Anything
else (a prompt pass, another dtype, a backward, a wrong width) goes to the Python hook it was
made with, which steers it with PyTorch ops or says what is wrong. A 16-bit row is steered in
float32 and rounded back once, as the Python hook's casts do (equal up to that rounding). It is
built from the source below by ``torch.utils.cpp_extension`` the first time it is asked for
(about 30 s; it needs a C++ compiler and ``ninja``) and cached under ``$GSS_KERNEL_DIR`` or
``~/.cache/gss/kernels``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gss.errors import GSSError

SMALL_ROWS = 64  # rows (batch x positions) up to which the loop beats the ATen ops

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t SMALL_ROWS = @SMALL_ROWS@;
// the dtypes steerable() lets through, each run by its own steer_rows<scalar_t>
#define GSS_STEERED_TYPES(...)                  \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)  \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)
constexpr const char* CAPSULE = "gss.cpu_steer_hook";

// What one hook steers with: the fused steer's tensors (float32, contiguous, CPU) and the
// Python hook that takes every input this one was not built for.
struct Steer {
  at::Tensor probe;       // (k, d): the probe rows divided by their thresholds
  at::Tensor neg_offset;  // (k,)
  at::Tensor neg_steer;   // (k, d): the negated steer rows times their thresholds
  at::Tensor on;          // bool scalar: false while the Python hook must see every call
  int64_t d = 0, k = 0;
  bool hard = true;
  PyObject* fallback = nullptr;  // owned
  std::vector<float> wide;       // a bfloat16 or float16 row widened, and its steered copy
  ~Steer() { Py_XDECREF(fallback); }
};

void destroy(PyObject* capsule) {
  delete static_cast<Steer*>(PyCapsule_GetPointer(capsule, CAPSULE));
}

// y = x + sum_j shrink(x . probe_j + neg_offset_j) neg_steer_j per row, shrink = hardshrink
// at 1 (hard) or nothing: what GatedSteer's fused path computes with three ATen ops, in
// float32. A bfloat16 or float16 row is widened into `wide` first and the steered row rounded
// back once, as the ops' casts around them do; a row whose gates all stay closed comes back
// bit for bit (widening and rounding back is exact).
template <typename T>
void steer_rows(const Steer& st, const T* x0, T* y0, int64_t rows, float* wide) {
  const int64_t d = st.d, k = st.k;
  const float* p = st.probe.data_ptr<float>();
  const float* b = st.neg_offset.data_ptr<float>();
  const float* n = st.neg_steer.data_ptr<float>();
  constexpr int64_t W = 8;  // independent partial sums: the compiler vectorizes the dot
  const int64_t body = d - d % W;
  for (int64_t r = 0; r < rows; ++r) {
    float* y;
    const float* x;
    if constexpr (std::is_same_v<T, float>) {
      x = x0 + r * d;
      y = y0 + r * d;
      std::copy(x, x + d, y);
    } else {
      const T* xt = x0 + r * d;
      x = wide + d;  // the row as read; `wide` itself becomes the steered row
      y = wide;
      for (int64_t i = 0; i < d; ++i) y[i] = wide[d + i] = static_cast<float>(xt[i]);
    }
    for (int64_t j = 0; j < k; ++j) {
      const float* pj = p + j * d;
      float acc[W] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < body; i += W)
        for (int64_t u = 0; u < W; ++u) acc[u] += x[i + u] * pj[i + u];
      float s = b[j];
      for (int64_t u = 0; u < W; ++u) s += acc[u];
      for (int64_t i = body; i < d; ++i) s += x[i] * pj[i];
      if (st.hard && s >= -1.0f && s <= 1.0f) continue;  // a closed gate: no correction at all
      const float* nj = n + j * d;
      for (int64_t i = 0; i < d; ++i) y[i] += s * nj[i];
    }
    if constexpr (!std::is_same_v<T, float>) {
      T* yt = y0 + r * d;
      for (int64_t i = 0; i < d; ++i) yt[i] = static_cast<T>(y[i]);
    }
  }
}

// The block output's hidden states if this hook steers them, else nullptr.
const at::Tensor* steerable(const Steer& st, PyObject* hidden) {
  if (!THPVariable_CheckExact(hidden)) return nullptr;  // a subclass keeps its own semantics
  const at::Tensor& h = THPVariable_Unpack(hidden);
  const auto dtype = h.defined() ? h.scalar_type() : at::kFloat;
  if (!h.defined() || h.layout() != at::kStrided || !h.device().is_cpu() ||
      (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) ||
      !h.has_storage() || h.dim() < 1 ||
      h.size(-1) != st.d || h.numel() > SMALL_ROWS * st.d || !h.is_contiguous() || h.is_neg())
    return nullptr;
  if (at::GradMode::is_enabled() && h.requires_grad()) return nullptr;  // autograd: ATen
  return &h;
}

// The forward hook: hook(module, args, output) -> the steered output, or the Python hook's
// answer for anything steerable() refuses. Tracing and torch function or dispatch modes must
// see the steer's ops, so they get the Python hook too.
PyObject* hook(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* st = static_cast<Steer*>(PyCapsule_GetPointer(self, CAPSULE));
  if (st == nullptr) return nullptr;
  if (nargs == 3 && *st->on.data_ptr<bool>() && !torch::jit::tracer::isTracing() &&
      !c10::impl::dispatch_mode_enabled() && !at::impl::torch_function_mode_enabled()) {
    PyObject* output = args[2];
    const bool tuple = PyTuple_CheckExact(output) && PyTuple_GET_SIZE(output) > 0;
    PyObject* hidden = tuple ? PyTuple_GET_ITEM(output, 0) : output;
    PyObject* steered = nullptr;
    try {
      if (const at::Tensor* h = steerable(*st, hidden)) {
        const auto dtype = h->scalar_type();
        at::TensorBase out = at::detail::empty_cpu(h->sizes(), dtype);
        const int64_t rows = h->numel() / st->d;
        st->wide.resize(2 * st->d);  // for 16-bit rows: allocated on the first call only
        AT_DISPATCH_SWITCH(dtype, "gss_cpu_steer", GSS_STEERED_TYPES([&] {
          steer_rows(*st, h->data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
                     st->wide.data());
        }));
        steered = THPVariable_Wrap(out);
        if (steered == nullptr) return nullptr;
      }
    } catch (const std::exception&) {
      steered = nullptr;  // whatever torch refused here, the Python hook checks and says
    }
    if (steered != nullptr) {
      if (!tuple) return steered;
      const Py_ssize_t n = PyTuple_GET_SIZE(output);  // transformers 4: (hidden, cache, ...)
      PyObject* rebuilt = PyTuple_New(n);
      if (rebuilt == nullptr) {
        Py_DECREF(steered);
        return nullptr;
      }
      PyTuple_SET_ITEM(rebuilt, 0, steered);
      for (Py_ssize_t i = 1; i < n; ++i) {
        PyObject* item = PyTuple_GET_ITEM(output, i);
        Py_INCREF(item);
        PyTuple_SET_ITEM(rebuilt, i, item);
      }
      return rebuilt;
    }
  }
  return PyObject_Vectorcall(st->fallback, args, nargs, nullptr);
}

PyMethodDef HOOK_DEF = {
    "gss_cpu_steer_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(hook)),
    METH_FASTCALL, "gss's fused gated steer as a forward hook (see gss.steering.cpu_kernel)."};

void check(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim &&
                  t.is_contiguous(),
              "gss CPU kernel: ", name, " must be a contiguous float32 CPU tensor of ", dim,
              " dimensions");
}

}  // namespace

// A new hook over these tensors; the tensors are held, not copied.
py::object make_hook(const at::Tensor& probe, const at::Tensor& neg_offset,
                     const at::Tensor& neg_steer, const at::Tensor& on, bool hard,
                     py::object fallback) {
  check(probe, 2, "probe");
  check(neg_offset, 1, "neg_offset");
  check(neg_steer, 2, "neg_steer");
  TORCH_CHECK(neg_steer.sizes() == probe.sizes() && neg_offset.size(0) == probe.size(0),
              "gss CPU kernel: probe, neg_offset and neg_steer disagree on K or d");
  TORCH_CHECK(on.device().is_cpu() && on.scalar_type() == at::kBool && on.numel() == 1,
              "gss CPU kernel: on must be a bool CPU scalar");
  auto st = std::make_unique<Steer>();
  st->probe = probe;
  st->neg_offset = neg_offset;
  st->neg_steer = neg_steer;
  st->on = on;
  st->k = probe.size(0);
  st->d = probe.size(1);
  st->hard = hard;
  st->fallback = fallback.release().ptr();
  PyObject* capsule = PyCapsule_New(st.get(), CAPSULE, destroy);
  if (capsule == nullptr) throw py::error_already_set();
  st.release();  // the capsule owns it now
  PyObject* fn = PyCFunction_New(&HOOK_DEF, capsule);
  Py_DECREF(capsule);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("make_hook", &make_hook);
}
""".replace("@SMALL_ROWS@", str(SMALL_ROWS))

_loaded: dict[str, Callable[..., Callable[..., Any]]] = {}


def _name() -> str:
    """The build's name: the source, torch and Python versions, so an upgrade rebuilds."""
    key = f"{_SOURCE}|{torch.__version__}|{sys.version_info[:2]}".encode()
    return "gss_cpu_steer_" + hashlib.sha256(key).hexdigest()[:12]


def kernel_dir() -> Path:
    """``$GSS_KERNEL_DIR`` if set, else ``~/.cache/gss/kernels``."""
    env = os.environ.get("GSS_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "gss" / "kernels"


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Hold the build directory for this process. torch marks a build in progress with a
    ``lock`` file and waits, forever, for it to go; a build that was killed (Ctrl-C during the
    first ~30 s) leaves it behind, and every later attach with ``cpu_kernel=True`` would hang.
    An OS lock is released when its process dies, so while this process holds one, a ``lock``
    file can only be a dead build's, and is removed. Without ``fcntl`` (Windows) torch's file
    is left alone."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(build / "gss-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another process's build: wait for it to finish
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load() -> Callable[..., Callable[..., Any]]:
    """The compiled ``make_hook(probe, neg_offset, neg_steer, on, hard, fallback)``, built on
    first use: it returns a hook (a C function called as ``hook(module, args, output)``) over
    those float32 CPU tensors, which steers while the bool scalar ``on`` is true and calls
    ``fallback`` with whatever it does not steer."""
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
        with _build_lock(build):
            module: Any = load_inline(
                name,
                cpp_sources=_SOURCE,
                functions=None,  # the source binds make_hook itself
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
    fn = module.make_hook
    _loaded[name] = fn
    return fn
