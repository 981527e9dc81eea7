"""A vLLM general plugin that applies gss artifacts inside vLLM's model runner, per request.

Setup (every vLLM process, engine and workers, reads the same environment)::

    from gss.serving import vllm_plugin
    vllm_plugin.configure({"no-leaks": "/path/to/artifact"})   # sets GSS_VLLM_ARTIFACTS
    llm = vllm.LLM(model_dir, dtype="float32")
    llm.generate(prompts, SamplingParams(max_tokens=32, extra_args={"gss": "no-leaks"}))

and over the OpenAI server: ``gss serve --model DIR --artifact no-leaks=/path`` (vLLM's
server with ``--additional-config '{"gss_artifacts": {"no-leaks": "/path"}}'``, see
`gss.serving.serve` and docs/serving.md) with ``"vllm_xargs": {"gss": "no-leaks"}`` in the
request body (``extra_body`` in the OpenAI client). A request without the ``gss`` key is not
steered, bit for bit, unless the server has a default artifact (``gss serve --default NAME``,
``additional_config={"gss_default": NAME}``, ``configure(..., default=NAME)``): then it is
steered by that one, and ``{"gss": "none"}`` opts a request out. One naming an artifact the
server does not have is refused (HTTP 400).

How it works (see the notes of issue 40):

* `register` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process. It
  only arranges for vLLM's model runner classes (and its ``Request`` and ``InputProcessor``) to
  be patched when (and if) their modules are imported, so process0 imports nothing more; the
  patched runner steers nothing unless artifacts are configured (``GSS_VLLM_ARTIFACTS``, or
  ``additional_config={"gss_artifacts": {name: dir}}``, what ``gss serve`` passes).
* After the runner loads the model (``load_model``), the decoder layer of each artifact's
  block gets a subclass whose ``forward`` passes the block output through the opaque custom op
  ``gss::vllm_steer`` (the steered output, and which tokens have an artifact) and keeps the
  steered values on those tokens only, in traced code. vLLM's Llama-family layers return the
  MLP output and the residual separately (their sum is the block output gss steers): a steered
  token becomes (steered sum, 0), which the next layer's fused add-RMSNorm (or the final norm)
  adds, and every other token keeps its two outputs, so it reaches that norm with the same bits
  as without the plugin, in bfloat16 and compiled too. A layer returning one tensor, as GPT-2's
  and the Transformers backend's do, has it steered as it is.
  This is done before vLLM's warm-up, so torch.compile traces the op into its graph, and the
  steered layers are written into ``additional_config``, which keys vLLM's compile cache.
* Before every forward (``GPUModelRunner._model_forward``, which the CPU runner inherits) the
  runner's batch (``input_batch.req_ids`` in order, ``query_start_loc``) is turned into one
  artifact slot per token in a persistent buffer the op reads, rewritten only where a step's
  slots differ from the last step's (a steady decode batch costs the host no device call); a
  dummy run (``_dummy_run``: warm-up, CUDA-graph capture) clears it first, so it steers nothing.
  Under continuous batching and chunked prefill every token gets its own request's slot.
  Model Runner V2 (vLLM's default on CUDA) has neither: there the slots follow its requests
  (``add_requests`` / ``_remove_request``) and the batch its ``prepare_inputs`` returns, kept
  the same way; its dummy runs and CUDA-graph capture clear them (`_patch_v2_runner_class`).
* A request naming an unknown artifact is refused where vLLM validates its parameters
  (``InputProcessor._validate_params``, in the frontend), before it reaches the engine.
* The steer itself is `gss.steering.gated.GatedSteer.steer_hidden`, the same arithmetic as
  ``gss.steer`` on a transformers model; the op keeps it on the tokens whose slot names its
  artifact (``torch.where``), and the token's block output unchanged elsewhere. On CUDA one
  Triton kernel does the op's work (`gss.serving.triton_steer`, the same folded tensors;
  ``GSS_VLLM_TRITON=0``: torch's ops): inside a CUDA graph each small kernel is a node.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gss.steering.gated import resolve_device

ENV = "GSS_VLLM_ARTIFACTS"
"""JSON object {name: artifact directory}, or ``name=dir,name2=dir2``."""
EXTRA_ARG = "gss"
"""The key of ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP) naming the artifact."""
CONFIG_KEY = "gss_artifacts"
"""The key of vLLM's ``additional_config`` that may name the artifacts instead of ``ENV``."""
PLUGIN_NAME = "gss"
"""The entry point's name (what ``VLLM_PLUGINS`` lists to allow it)."""
DEFAULT_KEY = "gss_default"
"""The key of ``additional_config`` naming the artifact that steers requests naming none."""
DEFAULT_ENV = "GSS_VLLM_DEFAULT"
"""The same as an environment variable (``configure(..., default=NAME)`` sets it)."""
TRITON_ENV = "GSS_VLLM_TRITON"
"""``0``: the op steers with torch's ops on CUDA too; ``1``: with the Triton kernel anywhere;
unset or ``auto``: the kernel on CUDA where Triton is (`use_triton`)."""
NO_STEER = "none"
"""The name a request asks for to be served unsteered, whatever the server's default."""

_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
_REQUEST_MODULE = "vllm.v1.request"
_INPUT_MODULE = "vllm.v1.engine.input_processor"
# vLLM's Model Runner V2 (the default on CUDA where Triton is installed; the CPU build's V2
# runner subclasses it), and the methods of it the plugin wraps
_V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
_V2_HOOKS = (
    "load_model",
    "add_requests",
    "_remove_request",
    "prepare_inputs",
    "execute_model",
    "capture_model",
)
_PATCHED_MODULES = (*_RUNNER_MODULES, _REQUEST_MODULE, _INPUT_MODULE, _V2_RUNNER_MODULE)
_NO_SLOT = -1


def configure(artifacts: Mapping[str, str | os.PathLike[str]], default: str | None = None) -> None:
    """Name the artifacts requests may ask for, and the one (if any) that steers the requests
    that name none, in this process's environment (which vLLM's engine and worker processes
    inherit): call it before creating the engine."""
    names = {str(k): str(Path(v).resolve()) for k, v in artifacts.items()}
    check_names(names, default)
    os.environ[ENV] = json.dumps(names)
    if default is None:
        os.environ.pop(DEFAULT_ENV, None)
    else:
        os.environ[DEFAULT_ENV] = default


def check_names(names: Collection[str], default: str | None) -> None:
    """Refuse an artifact named ``none`` (what a request says to opt out of the default) and a
    default the server does not serve."""
    from gss.errors import GSSError

    if NO_STEER in names:
        raise GSSError(
            f"an artifact is named {NO_STEER!r}, the name a request gives to be served "
            "unsteered: give it another name."
        )
    if default is not None and default not in names:
        raise GSSError(
            f"the default artifact (--default) {default!r} is not one the server serves "
            f"({sorted(names)}): name one of those, or none (requests that name none are then "
            "not steered)."
        )


def default_name(vllm_config: Any = None) -> str | None:
    """The artifact that steers requests naming none: the engine's ``additional_config``
    ``gss_default``, else ``GSS_VLLM_DEFAULT``, else None (they are not steered)."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and extra.get(DEFAULT_KEY) is not None:
        return str(extra[DEFAULT_KEY])
    return os.environ.get(DEFAULT_ENV, "").strip() or None


def artifact_paths(vllm_config: Any = None) -> dict[str, str]:
    """The {name: directory} requests may ask for: ``GSS_VLLM_ARTIFACTS``, then the engine's
    ``additional_config={"gss_artifacts": {...}}`` (``--additional-config`` of ``vllm serve``),
    which wins for a name in both."""
    out: dict[str, str] = {}
    raw = os.environ.get(ENV, "").strip()
    if raw.startswith("{"):
        out.update({str(k): str(v) for k, v in json.loads(raw).items()})
    elif raw:
        for item in raw.split(","):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"{ENV} entries are name=directory, got {item!r}")
            out[name.strip()] = path.strip()
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get(CONFIG_KEY), dict):
        out.update({str(k): str(v) for k, v in extra[CONFIG_KEY].items()})
    return out


# --------------------------------------------------------------------------------------------
# state shared by the runner patch and the op (one per worker process)


class _State:
    def __init__(self) -> None:
        self.names: dict[str, int] = {}  # artifact name -> slot
        self.default = _NO_SLOT  # the slot of a request that names no artifact
        self.by_layer: dict[int, list[tuple[int, Any]]] = {}  # layer -> [(slot, GatedSteer)]
        # layer -> [(slot, TritonSteer)] where the Triton kernel steers it (`prepare`), and
        # the device it was built for
        self.kernels: dict[int, list[tuple[int, Any]]] = {}
        self.kernel_device: torch.device | None = None
        self.slots: Tensor | None = None  # (max tokens,) int32: the slot of each token
        # the slots `slots` holds in its first rows, as int32 bytes (every later row: none),
        # so that a step whose tokens keep their slots (a steady decode batch) writes nothing
        self.held = b""
        # the step whose slots `held` are (its request ids, where each one's tokens start): a
        # step of the same requests with as many tokens each has the same slots, unless a
        # request came or went since (`forget_batch`; an id may come back as a new request)
        self.batch: tuple[tuple[str, ...], bytes] | None = None
        self.rows: np.ndarray | None = None  # host rows written into: `slots` itself on a CPU
        self.staging: Tensor | None = None  # on CUDA: `rows` as a pinned tensor, copied from
        self.copied: Any = None  # on CUDA: an event after the last copy out of `staging`
        self.loaded = False
        self.lock = threading.Lock()

    def load(self, paths: Mapping[str, str], default: str | None = None) -> None:
        """Load the artifacts (once a process): their hooks, by layer; ``default`` names the
        one that steers requests naming none."""
        with self.lock:
            if self.loaded:
                return
            import gss

            check_names(paths, default)
            for slot, (name, path) in enumerate(sorted(paths.items())):
                loaded = gss.load(path)
                members: list[Any] = (
                    list(loaded) if isinstance(loaded, gss.SteeringStack) else [loaded]
                )
                self.names[name] = slot
                for art in members:
                    hook = art.make_hook()
                    hook.origin = art
                    self.by_layer.setdefault(art.layer, []).append((slot, hook))
            self.default = _NO_SLOT if default is None else self.names[default]
            self.loaded = True

    def slot_of(self, params: Any) -> int:
        name = steer_name(params)
        if name is None:
            return self.default
        if name == NO_STEER:
            return _NO_SLOT
        slot = self.names.get(name)
        if slot is None:
            from gss.errors import GSSError

            raise GSSError(unknown_name_message(name, sorted(self.names)))
        return slot

    def prepare(self, device: torch.device, dtype: torch.dtype, max_tokens: int) -> None:
        """Allocate the slot buffer and put every steer on the model's device and dtype
        before vLLM's warm-up and CUDA-graph capture: a graph keeps reading the buffer it was
        captured with, and a steer's first call must not allocate inside a capture."""
        self.buffer(max_tokens, device)
        for entries in self.by_layer.values():
            for _, hook in entries:
                hook.prepare(device, dtype)
        self.kernels, self.kernel_device = {}, None
        if use_triton(device, dtype):
            from gss.serving.triton_steer import TritonSteer

            device = resolve_device(device)
            for layer, entries in self.by_layer.items():
                folded = [(slot, hook.folded(device)) for slot, hook in entries]
                if all(tensors is not None for _, tensors in folded):
                    self.kernels[layer] = [
                        (slot, TritonSteer(probe, offset, steer, hard=hard))
                        for slot, (probe, offset, steer, hard) in folded
                    ]
            self.kernel_device = device
            self._compile_kernels(device, dtype)

    def _compile_kernels(self, device: torch.device, dtype: torch.dtype) -> None:
        """Launch each layer's kernels once on one token, in every form a forward may take
        (with a residual or not), so that Triton compiles them here, before vLLM's warm-up and
        CUDA-graph capture. A layer whose kernel does not compile or run (a Triton too old or
        too new for it) steers with torch's ops, with a warning; with ``GSS_VLLM_TRITON=1``
        the engine stops instead, naming the error."""
        slots = self.slots
        assert slots is not None
        for layer, kernels in list(self.kernels.items()):
            try:
                for slot, kernel in kernels:
                    token = torch.zeros((1, kernel.width), dtype=dtype, device=device)
                    for residual in (None, token):
                        kernel(token, residual, slots, slot, pass_through=len(kernels) > 1)
            except Exception as err:  # Triton's compile and launch errors have many types
                if triton_setting(os.environ) == "1":
                    from gss.errors import GSSError

                    raise GSSError(
                        f"{TRITON_ENV}=1 but gss's Triton kernel does not run here ({err}): "
                        f"unset {TRITON_ENV} to steer with torch's ops."
                    ) from err
                logging.getLogger("vllm.gss").warning(
                    "gss's Triton kernel does not run here (%s): layer %d steers with torch's ops",
                    err,
                    layer,
                )
                del self.kernels[layer]

    def buffer(self, size: int, device: torch.device) -> Tensor:
        """The slot buffer, the same tensor every step (captured graphs read it), unless it
        is too small or on another device."""
        device = resolve_device(device)
        slots = self.slots
        if slots is None or slots.shape[0] < size or slots.device != device:
            slots = torch.full((max(size, 1),), _NO_SLOT, dtype=torch.int32, device=device)
            self.slots, self.held, self.batch = slots, b"", None
            if slots.is_cuda:  # made here, never inside a step (nor a CUDA-graph capture)
                self.staging = torch.empty(slots.shape, dtype=torch.int32, pin_memory=True)
                self.rows, self.copied = self.staging.numpy(), torch.cuda.Event()
            else:
                self.staging, self.rows, self.copied = None, slots.numpy(), None
        return slots

    def write(self, per_token: np.ndarray, size: int, device: torch.device) -> None:
        """Put ``per_token`` (each scheduled token's slot, in the runner's order, int32) in the
        buffer the op reads, every later row no slot. Nothing to do where the buffer holds
        them already (a decode batch whose requests did not change); else NumPy writes the
        rows, and on CUDA one copy takes them from pinned memory to the device. A copy from
        pageable memory may wait for the stream (CUDA's synchronization rules), which would
        stall vLLM's asynchronous scheduling. Before, every step took a new pinned block, a
        copy and two fills of the device buffer: 0.14 ms a decode step on an H200's host, 10-16%
        of SmolLM2-135M's step (results/serve-op-share-cuda)."""
        per_token = per_token.astype(np.int32, copy=False)
        n = per_token.shape[0]
        slots = self.buffer(max(n, size), device)
        key = per_token.tobytes()  # comparing bytes: 0.05 us where np.array_equal takes 1.8
        if key == self.held:
            return
        end = max(n, len(self.held) // 4)  # the rows that held slots until now get none
        staging, rows = self.staging, self.rows
        assert rows is not None
        if staging is not None:
            self.copied.synchronize()  # the last copy out of the pinned rows has run
        rows[:n] = per_token
        rows[n:end] = _NO_SLOT
        if staging is not None:
            slots[:end].copy_(staging[:end], non_blocking=True)
            self.copied.record()
        self.held = key

    def clear(self) -> None:
        """No slot for any token: before a dummy run (warm-up, CUDA-graph capture, an idle
        data-parallel rank's step), which then steers nothing."""
        self.batch = None
        if self.slots is not None and self.held:
            self.slots.fill_(_NO_SLOT)
            self.held = b""

    def steer(
        self, layer: int, h: Tensor, residual: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``h`` (tokens x hidden, or 1 x tokens x hidden where vLLM runs a transformers
        model through its Transformers backend), plus ``residual`` if given, with each token
        steered by its slot's artifact, and which tokens have an artifact at ``layer``
        (``h.shape[:-1] + (1,)``; None where no artifact is at this layer). The rows of the
        other tokens are undefined: the steered layer keeps its outputs there
        (`_steered_class`). On CUDA one Triton kernel does it all (`gss.serving.triton_steer`;
        `use_triton`), elsewhere torch's ops.

        The slots are read here, inside the opaque op, not in the layer's traced code: a
        tensor the traced code reads (a buffer or attribute of the layer) is a constant to
        inductor when it freezes the model (vLLM's CPU runner does under ``max_autotune``),
        and a frozen copy of the slots would steer every later step by the first one's."""
        entries = self.by_layer.get(layer, ())
        slots = self.slots
        if not entries or slots is None:
            return h, None
        kernels = self.kernels.get(layer)
        if kernels is not None and h.device == self.kernel_device:
            return _triton_steer(kernels, slots, h, residual)
        if residual is not None:
            h = h + residual
        out = h.reshape(-1, h.shape[-1])  # one row per token, in the runner's order
        token_slot = slots[: out.shape[0]].unsqueeze(-1)
        hit: Tensor | None = None
        for slot, hook in entries:
            mine = token_slot == slot
            steered, _ = hook.steer_hidden(out)
            # one artifact at the layer (the common case): no selection here, the layer's
            # selection is the only one (a kernel less a step, in the CUDA graph too)
            out = steered if len(entries) == 1 else torch.where(mine, steered, out)
            hit = mine if hit is None else hit | mine
        assert hit is not None
        return out.view(h.shape), hit.view(*h.shape[:-1], 1)


_STATE = _State()


# --------------------------------------------------------------------------------------------
# the op: opaque to dynamo / inductor, so its body runs as written under vLLM's compilation


def steered_block_output(
    h: Tensor, layer: int, residual: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The block output ``h`` (``h + residual`` where a layer returns the two apart) with each
    token steered by the artifact of its request's slot, and which tokens have an artifact at
    ``layer`` (bool, ``h.shape[:-1] + (1,)``); the rows of the others are undefined
    (`_State.steer`). The body of the op ``gss::vllm_steer``."""
    steered, hit = _STATE.steer(layer, h, residual)
    if hit is None:  # nothing to steer; a custom op may not return its input
        return h.clone(), torch.zeros((*h.shape[:-1], 1), dtype=torch.bool, device=h.device)
    return steered, hit  # a new tensor: the steer, the sum or torch.where made it


@torch.library.custom_op("gss::vllm_steer", mutates_args=())
def vllm_steer(h: Tensor, layer: int, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`steered_block_output` as an op vLLM's compilation keeps as one opaque call."""
    return steered_block_output(h, layer, residual)


@vllm_steer.register_fake
def _(h: Tensor, layer: int, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return torch.empty_like(h), h.new_empty((*h.shape[:-1], 1), dtype=torch.bool)


def triton_setting(environ: Mapping[str, str]) -> str:
    """``GSS_VLLM_TRITON`` as ``0``, ``1`` or ``auto`` (unset); anything else is refused."""
    wanted = environ.get(TRITON_ENV, "auto").strip().lower()
    if wanted not in ("0", "1", "auto"):
        from gss.errors import GSSError

        raise GSSError(
            f"{TRITON_ENV}={wanted!r}: give 0 (the steer as torch's ops), 1 (as gss's Triton "
            "kernel) or auto (the kernel on CUDA), or unset it."
        )
    return wanted


def use_triton(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the op steers with the Triton kernel (`gss.serving.triton_steer`): for
    float32, bfloat16 and float16 on CUDA, where Triton is installed (vLLM's CUDA install
    brings it); never with ``GSS_VLLM_TRITON=0`` (torch's ops then, as on a CPU); with
    ``GSS_VLLM_TRITON=1`` on a CPU too, in Triton's interpreter (``TRITON_INTERPRET=1``: for
    tests), and an error where Triton does not load."""
    wanted = triton_setting(os.environ)
    on_cuda = torch.device(device).type == "cuda"
    if wanted == "0" or (wanted == "auto" and not on_cuda):
        return False
    from gss.errors import GSSError

    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise GSSError(
            f"{TRITON_ENV}=1 on a {torch.device(device).type} device: Triton runs there only "
            f"in its interpreter (set TRITON_INTERPRET=1 too), or unset {TRITON_ENV}."
        )
    try:
        from gss.serving.triton_steer import DTYPES
    except ImportError as err:
        if wanted == "1":
            raise GSSError(
                f"{TRITON_ENV}=1 but Triton does not load ({err}): install triton, or unset "
                f"{TRITON_ENV} to steer with torch's ops."
            ) from err
        return False
    return dtype in DTYPES


def _triton_steer(
    kernels: list[tuple[int, Any]], slots: Tensor, h: Tensor, residual: Tensor | None
) -> tuple[Tensor, Tensor]:
    """`_State.steer` by the Triton kernel: one launch for a layer with one artifact (the
    sum of ``h`` and ``residual`` taken inside it); with several, each passes the rows of
    the others through to the next, from the sum taken first."""
    rows = h.reshape(-1, h.shape[-1])
    if rows.shape[0] > slots.shape[0]:  # the kernel would read past the buffer
        raise RuntimeError(
            f"gss's vLLM op got {rows.shape[0]} tokens, more than the {slots.shape[0]} its "
            "slot buffer was made for (the runner's max_num_tokens)"
        )
    extra = None if residual is None else residual.reshape(-1, residual.shape[-1])
    if rows.stride(-1) != 1 or (extra is not None and extra.stride(-1) != 1):
        rows = rows.contiguous()
        extra = None if extra is None else extra.contiguous()
    if len(kernels) == 1:
        ((slot, kernel),) = kernels
        out, hit = kernel(rows, extra, slots, slot)
    else:
        out = rows if extra is None else rows + extra
        hits = []
        for slot, kernel in kernels:
            out, mine = kernel(out, None, slots, slot, pass_through=True)
            hits.append(mine)
        hit = torch.stack(hits).any(0)
    return out.view(h.shape), hit.view(*h.shape[:-1], 1)


def _steered_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = cls.forward(self, *args, **kwargs)
        layer = self._gss_layer
        if isinstance(output, tuple) and len(output) == 2 and output[1] is not None:
            # steered tokens become (steered sum, 0), the others keep their two outputs bit
            # for bit. The selection is traced: in a compiled graph an unsteered token then
            # reaches the next layer's fused add-RMSNorm as without the plugin (a sum rounded
            # to bfloat16, or the selection made inside the opaque op, changed it)
            hidden, residual = output
            steered, hit = torch.ops.gss.vllm_steer(hidden, layer, residual)
            return torch.where(hit, steered, hidden), residual.masked_fill(hit, 0)
        if isinstance(output, Tensor):
            steered, hit = torch.ops.gss.vllm_steer(output, layer)
            return torch.where(hit, steered, output)
        raise TypeError(
            f"gss cannot steer {cls.__name__}: it returns {type(output).__name__}, not a "
            "tensor or (hidden_states, residual)"
        )

    return type(f"GSSSteered{cls.__name__}", (cls,), {"forward": forward})


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise RuntimeError(f"gss found no list of {num_layers} decoder layers in the vLLM model")


def _check_artifact(art: Any, model: nn.Module, hf_config: Any) -> None:
    """The artifact's model fingerprint against the vLLM model, where it can be read."""
    from gss.artifact.steering_artifact import _SAMPLE, fingerprint_differences
    from gss.errors import GSSError

    expected = art.provenance.fingerprint
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    actual: dict[str, Any] = {
        "model_type": getattr(hf_config, "model_type", None),
        "hidden_size": getattr(text, "hidden_size", None),
        "num_layers": getattr(text, "num_hidden_layers", None),
        "vocab_size": getattr(text, "vocab_size", None),
        "embedding_sample": [],
    }
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    vocab = actual["vocab_size"]
    if isinstance(weight, Tensor) and vocab and weight.shape[0] >= vocab:  # not sharded
        emb = weight[:vocab].detach()
        rows = torch.linspace(0, emb.shape[0] - 1, _SAMPLE).long().to(emb.device)
        cols = torch.linspace(0, emb.shape[1] - 1, _SAMPLE).long().to(emb.device)
        sample = emb[rows][:, cols].float().cpu()
        actual["embedding_sample"] = [round(v, 6) for v in sample.flatten().tolist()]
    diffs = fingerprint_differences(expected, actual) if expected else []
    if diffs:
        raise GSSError(
            "a gss artifact was calibrated for another model than the one vLLM serves: "
            + "; ".join(diffs)
        )


def unsupported_layout(vllm_config: Any) -> str | None:
    """Why the engine's token layout is one the op would steer wrongly (None: supported).
    The slot buffer holds one slot per token of the whole batch, in the runner's order; a
    forward that sees only part of the batch (micro-batches, tokens split across ranks by
    prefill context parallelism or by the sequence-parallelism compile pass) would read the
    wrong tokens' slots, as would Model Runner V2 re-laying speculative drafts on the device
    (adaptive verification), so such an engine is refused at start-up instead."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "use_ubatching", False):
        return "micro-batching (--enable-dbo / --ubatch-size)"
    if int(getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        return "prefill context parallelism (--prefill-context-parallel-size > 1)"
    passes = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    split = getattr(passes, "enable_sp", False) or getattr(passes, "fuse_gemm_comms", False)
    if split and int(getattr(parallel, "tensor_parallel_size", 1) or 1) > 1:
        return "sequence parallelism (compilation pass_config enable_sp / fuse_gemm_comms)"
    speculative = getattr(vllm_config, "speculative_config", None)
    if getattr(vllm_config, "use_v2_model_runner", False) and getattr(
        speculative, "enable_adaptive_verification", False
    ):  # V2 then re-lays the drafts' tokens on the device, past the host's batch layout
        return "adaptive verification of speculative drafts in Model Runner V2"
    return None


def install(runner: Any) -> bool:
    """Put the configured artifacts' steers on ``runner.model`` (once); False when none is
    configured (the model is left as it is)."""
    model = runner.model
    if getattr(model, "_gss_installed", False):
        return True
    paths = artifact_paths(runner.vllm_config)
    default = default_name(runner.vllm_config)
    if not paths:  # with a default set, a server its operator believes protected: refused
        check_names(paths, default)
        return False
    layout = unsupported_layout(runner.vllm_config)
    if layout is not None:
        from gss.errors import GSSError

        raise GSSError(
            f"gss's vLLM plugin does not steer an engine with {layout}: its forwards lay "
            "tokens out otherwise than the scheduled batch, so the plugin would steer the "
            "wrong tokens. Start the engine without it to serve gss artifacts "
            "(docs/serving.md, Limits)."
        )
    missing = missing_hooks(runner)
    if missing:
        from gss.errors import GSSError

        raise GSSError(
            f"gss's vLLM plugin cannot steer in {_vllm_version()}: {missing}, so "
            "its requests would be served unsteered. It is tested on vLLM 0.32 (CPU build) and "
            "0.26 (CUDA) and read against 0.33's source: install one of those (docs/serving.md)."
        )
    _STATE.load(paths, default)
    hf_config = runner.model_config.hf_config
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    layers = _decoder_layers(model, int(text.num_hidden_layers))
    for layer, entries in _STATE.by_layer.items():
        for _, hook in entries:
            _check_artifact(hook.origin, model, hf_config)
        block = layers[layer]
        if type(block).__name__ == "PPMissingLayer":  # another pipeline rank holds it
            continue
        if not hasattr(block, "_gss_layer"):
            block.__class__ = _steered_class(type(block))
            block._gss_layer = layer  # type: ignore[assignment]
    _mark_compile_key(runner.vllm_config)
    dtype = getattr(runner.model_config, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = next(model.parameters()).dtype
    _STATE.prepare(runner.device, dtype, int(getattr(runner, "max_num_tokens", 1)))
    model._gss_installed = True
    from vllm.logger import init_logger

    logger = init_logger("vllm.gss")
    logger.info(
        "gss steers decoder layer(s) %s for the artifact(s) %s (SamplingParams.extra_args / "
        "vllm_xargs {%r: name}); a request naming none: %s; the steer runs as %s",
        sorted(_STATE.by_layer),
        {name: paths[name] for name in sorted(_STATE.names)},
        EXTRA_ARG,
        "not steered" if default is None else f"steered by {default!r} ({NO_STEER!r} opts out)",
        steer_kernels(),
    )
    untested = untested_runner(runner)
    if untested:
        logger.warning(untested)
    return True


def steer_kernels() -> str:
    """What the op steers with, layer by layer, for the start-up log and benchmarks."""
    if not _STATE.kernels:
        return "torch's ops"
    rest = sorted(set(_STATE.by_layer) - set(_STATE.kernels))
    triton = f"the Triton kernel at layer(s) {sorted(_STATE.kernels)}"
    return triton if not rest else f"{triton}, torch's ops at {rest}"


def untested_runner(runner: Any) -> str | None:
    """A warning for a runner the plugin steers but has not been run with on its device
    (Model Runner V2 on CUDA); None for the others."""
    v2 = getattr(type(runner), "_gss_v2", False)
    return V2_ON_CUDA if v2 and torch.device(runner.device).type == "cuda" else None


def missing_hooks(runner: Any) -> str | None:
    """What of vLLM's model runner the plugin steers through this vLLM lacks (None: nothing).
    The patches find their methods by name and skip a class without them, so a vLLM that
    renamed one would load the steer and never fill its slots, or share steered requests'
    prefix cache with unsteered ones: checked where the steer is installed, before serving."""
    if getattr(type(runner), "_gss_v2", False):
        for name in _V2_HOOKS:
            if not getattr(getattr(type(runner), name, None), "_gss_hook", False):
                return f"its Model Runner V2 has no {name} the plugin could wrap"
    else:
        forward = getattr(type(runner), "_model_forward", None)
        if not getattr(forward, "_gss_fills_slots", False):
            return "its model runner has no _model_forward the plugin could wrap"
        if not getattr(getattr(type(runner), "_update_states", None), "_gss_hook", False):
            return "its model runner has no _update_states the plugin could wrap"
        for name in ("input_batch", "query_start_loc", "requests"):
            if not hasattr(runner, name):
                return f"its model runner keeps no {name!r}"
    request = getattr(importlib.import_module(_REQUEST_MODULE), "Request", None)
    if not getattr(request, "_gss_patched", False):
        return "its Request has no from_engine_core_request to salt steered requests' cache"
    return None


def _vllm_version() -> str:
    return f"vLLM {getattr(sys.modules.get('vllm'), '__version__', 'of unknown version')}"


def _mark_compile_key(vllm_config: Any) -> None:
    """Put the steered layers in ``additional_config``, which vLLM hashes into the key of its
    torch.compile cache (``VllmConfig.compute_hash``): without it an engine with the plugin and
    one without share a key, and one could load the other's compiled graph (with no steer in
    it, or a steer at other layers). Done in the worker before the first compiled call."""
    from gss import __version__

    mark = {
        "version": __version__,
        # a graph compiled against another signature of the op must not be reused
        "op": str(torch.ops.gss.vllm_steer.default._schema),
        "layers": sorted(_STATE.by_layer),
        "names": sorted(_STATE.names),
    }  # not the default: it only changes slots, which the compiled graph reads at run time
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        extra["gss_vllm_plugin"] = mark
    else:  # a config object of another plugin: no place to put it; no cache then
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"


def _fill_slots(runner: Any) -> None:
    """Before a forward of the V1 runner: each scheduled token's slot, from its request's."""
    batch = runner.input_batch
    num_reqs = int(batch.num_reqs)
    requests, ids = runner.requests, batch.req_ids[:num_reqs]

    def per_request() -> np.ndarray:
        try:  # every request's slot kept on it since its first step
            return np.fromiter((requests[r]._gss_slot for r in ids), np.int32, count=num_reqs)
        except AttributeError:  # a request's first step: look its slot up
            slots = (_request_slot(requests[r]) for r in ids)
            return np.fromiter(slots, np.int32, count=num_reqs)

    _write_slots(runner, ids, runner.query_start_loc.np[: num_reqs + 1], per_request)


def _write_slots(
    runner: Any, ids: Sequence[str], starts: Any, per_request: Callable[[], np.ndarray]
) -> None:
    """Write each request's slot (``per_request()``: one per request of ``ids``, in batch
    order) once per token of it (``starts``: where each request's tokens begin, and the end)
    into the buffer the op reads; every later row (padding tokens under CUDA graphs, stale
    rows) gets none. A step of the same requests with as many tokens each as the last one, no
    request having come or gone since (a steady decode batch), returns at once: its slots are
    in the buffer. Reading every request's slot and repeating it per token cost a steady step
    27-36 us inside a real engine on a 2-core CPU, 5-8 us without (`results/serve-fill-slots/
    in-engine-*.json`), and ~0.04 ms of an H200's host (`results/serve-op-share-cuda-2`)."""
    key = (tuple(ids), starts.tobytes())
    if key == _STATE.batch:
        return
    per_token = np.repeat(per_request(), np.diff(starts))
    _STATE.write(per_token, int(getattr(runner, "max_num_tokens", 1)), runner.device)
    _STATE.batch = key


def forget_batch() -> None:
    """A request came or went: the next step looks its requests' slots up again, even where
    its request ids and token counts equal the last step's (vLLM takes an aborted request's id
    back for a new request)."""
    _STATE.batch = None


def _request_slot(request: Any) -> int:
    """The slot of a runner's request (its ``CachedRequestState``), looked up from its sampling
    parameters and kept on it for its later steps: a request's artifact does not change, and
    looking it up on every step made the fill 1.2-2.5x slower at 16-256 requests
    (`benchmarks/vllm_fill_slots.py`)."""
    slot: int | None = getattr(request, "_gss_slot", None)
    if slot is None:
        slot = _STATE.slot_of(request.sampling_params)
        with contextlib.suppress(AttributeError):  # a state that takes no new attribute
            request._gss_slot = slot
    return slot


def _patch_runner_class(cls: type) -> None:
    if cls.__dict__.get("_gss_patched"):
        return
    if "load_model" in cls.__dict__:
        load_model = cls.__dict__["load_model"]

        def patched_load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = load_model(self, *args, **kwargs)
            install(self)
            return result

        setattr(cls, "load_model", patched_load_model)  # noqa: B010
    if "_model_forward" in cls.__dict__:
        model_forward = cls.__dict__["_model_forward"]

        def patched_model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            # the slots stay in the buffer after the forward: the next step rewrites only
            # what changed, and a dummy run clears them first (below)
            if getattr(self.model, "_gss_installed", False):
                _fill_slots(self)
            return model_forward(self, *args, **kwargs)

        patched_model_forward._gss_fills_slots = True  # type: ignore[attr-defined]
        setattr(cls, "_model_forward", patched_model_forward)  # noqa: B010
    if "_update_states" in cls.__dict__:  # where V1's runner takes requests in and out
        update_states = cls.__dict__["_update_states"]

        def patched_update_states(self: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
            if scheduler_output.scheduled_new_reqs or scheduler_output.finished_req_ids:
                forget_batch()
            return update_states(self, scheduler_output, *args, **kw)

        patched_update_states._gss_hook = True  # type: ignore[attr-defined]
        setattr(cls, "_update_states", patched_update_states)  # noqa: B010
    if "_dummy_run" in cls.__dict__:  # the one other caller of the model in V1's runner
        dummy_run = cls.__dict__["_dummy_run"]

        def patched_dummy_run(self: Any, *args: Any, **kwargs: Any) -> Any:
            _STATE.clear()
            return dummy_run(self, *args, **kwargs)

        setattr(cls, "_dummy_run", patched_dummy_run)  # noqa: B010
    setattr(cls, "_gss_patched", True)  # noqa: B010


def steer_name(params: Any) -> str | None:
    """The artifact name a request's SamplingParams ask for (None: not steered)."""
    extra = getattr(params, "extra_args", None) or {}
    name = extra.get(EXTRA_ARG)
    return None if name is None else str(name)


def _patch_request_class(cls: type) -> None:
    """Salt the prefix cache of steered requests: a block's KV past the steered layer depends
    on the steer, so a steered request must not reuse an unsteered request's cached prefix
    (nor one steered by another artifact). vLLM keys cached blocks by token hash plus extra
    keys, ``cache_salt`` among them (vllm/v1/core/kv_cache_utils.py
    ``generate_block_hash_extra_keys``); the engine core builds its ``Request`` with
    ``Request.from_engine_core_request``, before any block is hashed."""
    if cls.__dict__.get("_gss_patched"):
        return
    original = cls.__dict__["from_engine_core_request"].__func__

    def from_engine_core_request(klass: type, request: Any, *args: Any, **kwargs: Any) -> Any:
        name = steer_name(getattr(request, "sampling_params", None))
        if name is not None:
            salt = getattr(request, "cache_salt", None)
            request.cache_salt = f"gss:{name}" + (f"|{salt}" if salt else "")
        return original(klass, request, *args, **kwargs)

    setattr(cls, "from_engine_core_request", classmethod(from_engine_core_request))  # noqa: B010
    setattr(cls, "_gss_patched", True)  # noqa: B010


def unknown_name_message(name: str, names: Sequence[str]) -> str:
    """Why a request asking for the artifact ``name`` is refused, where ``names`` are served."""
    served = f"the engine serves {sorted(names)}" if names else "the engine serves none"
    return (
        f"the request asks for the gss artifact {name!r} (extra_args / vllm_xargs "
        f"{{{EXTRA_ARG!r}: ...}}), but {served}: ask for one of those, or for {NO_STEER!r} "
        "(not steered)."
    )


def _patch_input_processor_class(cls: type) -> None:
    """Refuse a request naming an artifact the engine does not serve where vLLM validates a
    request's parameters (``InputProcessor._validate_params``, in the frontend process, before
    the request reaches the engine): a 400 over HTTP, a ValueError from ``LLM.generate``. The
    worker would otherwise find the unknown name at its next forward and stop the engine."""
    if cls.__dict__.get("_gss_patched"):
        return
    if "_validate_params" not in cls.__dict__:
        logging.getLogger("vllm.gss").warning(
            "gss: this vLLM's InputProcessor has no _validate_params: a request naming an "
            "artifact the engine does not serve is not refused up front, and stops the engine "
            "at its forward instead."
        )
        return
    validate = cls.__dict__["_validate_params"]

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = validate(self, params, *args, **kwargs)
        name = steer_name(params)
        if name is not None and name != NO_STEER:
            names = getattr(self, "_gss_names", None)
            if names is None:
                names = frozenset(artifact_paths(getattr(self, "vllm_config", None)))
                self._gss_names = names
            if name not in names:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(
                    unknown_name_message(name, sorted(names)), parameter="vllm_xargs", value=name
                )
        return result

    setattr(cls, "_validate_params", _validate_params)  # noqa: B010
    setattr(cls, "_gss_patched", True)  # noqa: B010


def _patch_module(module: ModuleType) -> None:
    if module.__name__ == _INPUT_MODULE:
        processor_cls = getattr(module, "InputProcessor", None)
        if isinstance(processor_cls, type):
            _patch_input_processor_class(processor_cls)
        return
    if module.__name__ == _REQUEST_MODULE:
        request_cls = getattr(module, "Request", None)
        if isinstance(request_cls, type) and "from_engine_core_request" in request_cls.__dict__:
            _patch_request_class(request_cls)
        return
    if module.__name__ == _V2_RUNNER_MODULE:
        v2 = getattr(module, "GPUModelRunner", None)
        if isinstance(v2, type):
            _patch_v2_runner_class(v2)
        return
    for name in ("GPUModelRunner", "CPUModelRunner"):
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            _patch_runner_class(cls)


V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its model runners (``0``: the V1 runner, ``1``: Model Runner V2)."""
V2_ON_CUDA = (
    "gss steers this engine through vLLM's Model Runner V2: on a GPU its tokens have equalled "
    "transformers', but in eager mode its unsteered log-probs differed from vLLM without the "
    f"plugin by up to 5e-5, not yet traced; its V1 runner ({V2_ENV}=0, what gss serve sets) "
    "has none of that (docs/serving.md, Limits)."
)


def _patch_v2_runner_class(cls: type) -> None:
    """Model Runner V2 (vLLM's default on CUDA with Triton) keeps no ``requests`` dict and no
    ``_model_forward``: each request's slot is looked up when the request is added
    (``add_requests``: its new requests' sampling parameters; a resumed request comes back as
    new) and dropped with it (``_remove_request``); the buffer is filled from the batch that
    ``prepare_inputs`` returns (``req_ids`` in order, ``query_start_loc_np``). As in the V1
    runner the slots stay in the buffer after the forward, so a steady decode step writes
    nothing; the buffer is cleared before the model runs on a dummy batch (``execute_model``
    with ``dummy_run=True``: warm-up, memory profiling, an idle data-parallel rank) and before
    ``capture_model`` (CUDA-graph capture, which calls the model directly)."""
    if cls.__dict__.get("_gss_patched"):
        return
    original: dict[str, Any] = {name: cls.__dict__.get(name) for name in _V2_HOOKS}

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original["load_model"](self, *args, **kwargs)
        install(self)
        return result

    def add_requests(self: Any, scheduler_output: Any) -> Any:
        result = original["add_requests"](self, scheduler_output)
        if getattr(self.model, "_gss_installed", False):
            slots = self.__dict__.setdefault("_gss_slots", {})
            for new in scheduler_output.scheduled_new_reqs:
                slots[new.req_id] = _STATE.slot_of(new.sampling_params)
        if scheduler_output.scheduled_new_reqs:
            forget_batch()
        return result

    def _remove_request(self: Any, req_id: str) -> Any:
        self.__dict__.get("_gss_slots", {}).pop(req_id, None)
        forget_batch()
        return original["_remove_request"](self, req_id)

    def prepare_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = original["prepare_inputs"](self, *args, **kwargs)
        if getattr(self.model, "_gss_installed", False):
            num_reqs = int(batch.num_reqs)
            starts = batch.query_start_loc_np[: num_reqs + 1]
            ids, slots = batch.req_ids[:num_reqs], self._gss_slots

            def per_request() -> np.ndarray:
                return np.fromiter(map(slots.__getitem__, ids), np.int32, count=num_reqs)

            _write_slots(self, ids, starts, per_request)
        return batch

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dummy_run"):  # how V2's _dummy_run calls it (0.26 to 0.33)
            _STATE.clear()
        return original["execute_model"](self, *args, **kwargs)

    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STATE.clear()  # V2's CUDA-graph capture calls the model itself, with dummy batches
        return original["capture_model"](self, *args, **kwargs)

    hooks: tuple[Any, ...] = (
        load_model,
        add_requests,
        _remove_request,
        prepare_inputs,
        execute_model,
        capture_model,
    )
    for hook in hooks:
        if original[hook.__name__] is not None:  # a vLLM without it: `missing_hooks` says so
            hook._gss_hook = True
            setattr(cls, hook.__name__, hook)
    setattr(cls, "_gss_v2", True)  # noqa: B010
    setattr(cls, "_gss_patched", True)  # noqa: B010


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the runner modules (and vLLM's Request) as they are imported: process0 never
    imports the runner's."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _PATCHED_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch_module(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point. It only arranges for vLLM's model runner to
    be patched when its module is imported (in the worker processes); the patch steers
    nothing unless artifacts are configured (``GSS_VLLM_ARTIFACTS`` or
    ``additional_config={"gss_artifacts": ...}``)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name in _PATCHED_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
