"""The gated steer as one op inside vLLM's forward: ``gss::vllm_steer``, and the state it reads.

After vLLM's runner loads the model (`gss.serving.vllm_plugin.install`), the decoder layer of
each artifact's block gets a subclass (`steered_class`) whose ``forward`` passes the block
output through the opaque custom op ``gss::vllm_steer`` (the steered output, and which tokens
have an artifact) and keeps the steered values on those tokens only, in traced code. vLLM's
Llama-family layers return the MLP output and the residual separately (their sum is the block
output gss steers): a steered token becomes (steered sum, 0), which the next layer's fused
add-RMSNorm (or the final norm) adds, and every other token keeps its two outputs, so it
reaches that norm with the same bits as without the plugin, in bfloat16 and compiled too. A
layer returning one tensor, as GPT-2's and the Transformers backend's do, has it steered as it
is. The op is opaque to dynamo and inductor, so its body runs as written under vLLM's
compilation, and torch.compile traces it into its graph.

Which artifact steers which token is a slot per token in a persistent buffer (`State`, one a
worker process: `STATE`), which vLLM's hooks fill before every forward. The steer itself is
`gss.steering.gated.GatedSteer.steer_hidden`, the same arithmetic as ``gss.steer`` on a
transformers model; the op keeps it on the tokens whose slot names its artifact
(``torch.where``), and the token's block output unchanged elsewhere. On CUDA one Triton kernel
does the op's work (`gss.serving.triton_steer`, the same folded tensors; ``GSS_VLLM_TRITON=0``:
torch's ops): inside a CUDA graph each small kernel is a node.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gss.serving.vllm_settings import (
    NO_STEER,
    TRITON_ENV,
    check_names,
    steer_name,
    triton_setting,
    unknown_name_message,
)
from gss.steering.gated import resolve_device

NO_SLOT = -1
"""The slot of a token no artifact steers."""


class State:
    """The artifacts a worker process serves (their steers by layer, a slot each) and the
    slot buffer the op reads, one slot per token of the step. vLLM's hooks fill it
    (`gss.serving.vllm_plugin`), the op reads it: one a process, `STATE`, which both read at
    call time (benchmarks and tests swap it)."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}  # artifact name -> slot
        self.default = NO_SLOT  # the slot of a request that names no artifact
        self.opt_out = NO_SLOT  # the slot of one asking for "none": the default's if locked
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
        # request came or went since (`vllm_plugin.forget_batch`; an id may come back as a new one)
        self.batch: tuple[tuple[str, ...], bytes] | None = None
        self.rows: np.ndarray | None = None  # host rows written into: `slots` itself on a CPU
        self.staging: Tensor | None = None  # on CUDA: `rows` as a pinned tensor, copied from
        self.copied: Any = None  # on CUDA: an event after the last copy out of `staging`
        self.loaded = False
        self.lock = threading.Lock()

    def load(
        self, paths: Mapping[str, str], default: str | None = None, allow_opt_out: bool = False
    ) -> None:
        """Load the artifacts (once a process): their hooks, by layer; ``default`` names the
        one that steers requests naming none, and, unless ``allow_opt_out``, those asking for
        ``"none"`` too (the frontend refuses them first: `vllm_plugin`)."""
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
            self.default = NO_SLOT if default is None else self.names[default]
            self.opt_out = NO_SLOT if default is None or allow_opt_out else self.default
            self.loaded = True

    def slot_of(self, params: Any) -> int:
        name = steer_name(params)
        if name is None:
            return self.default
        if name == NO_STEER:
            return self.opt_out
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
            slots = torch.full((max(size, 1),), NO_SLOT, dtype=torch.int32, device=device)
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
        of SmolLM2-135M's step (results/serve-op-share-cuda at commit 8930497)."""
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
        rows[n:end] = NO_SLOT
        if staging is not None:
            slots[:end].copy_(staging[:end], non_blocking=True)
            self.copied.record()
        self.held = key

    def clear(self) -> None:
        """No slot for any token: before a dummy run (warm-up, CUDA-graph capture, an idle
        data-parallel rank's step), which then steers nothing."""
        self.batch = None
        if self.slots is not None and self.held:
            self.slots.fill_(NO_SLOT)
            self.held = b""

    def steer(
        self, layer: int, h: Tensor, residual: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``h`` (tokens x hidden, or 1 x tokens x hidden where vLLM runs a transformers
        model through its Transformers backend), plus ``residual`` if given, with each token
        steered by its slot's artifact, and which tokens have an artifact at ``layer``
        (``h.shape[:-1] + (1,)``; None where no artifact is at this layer). The rows of the
        other tokens are undefined: the steered layer keeps its outputs there
        (`steered_class`). On CUDA one Triton kernel does it all (`gss.serving.triton_steer`;
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


STATE = State()
"""The worker process's state: what the op reads and vLLM's hooks fill."""


def steered_block_output(
    h: Tensor, layer: int, residual: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The block output ``h`` (``h + residual`` where a layer returns the two apart) with each
    token steered by the artifact of its request's slot, and which tokens have an artifact at
    ``layer`` (bool, ``h.shape[:-1] + (1,)``); the rows of the others are undefined
    (`State.steer`). The body of the op ``gss::vllm_steer``."""
    steered, hit = STATE.steer(layer, h, residual)
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
    """`State.steer` by the Triton kernel: one launch for a layer with one artifact (the
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


def steered_class(cls: type[nn.Module]) -> type[nn.Module]:
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


def steer_kernels() -> str:
    """What the op steers with, layer by layer, for the start-up log and benchmarks."""
    if not STATE.kernels:
        return "torch's ops"
    rest = sorted(set(STATE.by_layer) - set(STATE.kernels))
    triton = f"the Triton kernel at layer(s) {sorted(STATE.kernels)}"
    return triton if not rest else f"{triton}, torch's ops at {rest}"
