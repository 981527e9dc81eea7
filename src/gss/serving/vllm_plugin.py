"""A vLLM general plugin that applies gss artifacts inside vLLM's model runner, per request:
vLLM's hooks. Which artifacts are served and asked for is `gss.serving.vllm_settings`
(``configure`` is re-exported here); the steer inside the forward is `gss.serving.vllm_op`.

How it works (see the notes of issue 40):

* `register` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process. It
  only arranges for vLLM's model runner classes (and its ``Request`` and ``InputProcessor``) to
  be patched when (and if) their modules are imported, so process0 imports nothing more; the
  patched runner steers nothing unless artifacts are configured (``GSS_VLLM_ARTIFACTS``, or
  ``additional_config={"gss_artifacts": {name: dir}}``, what ``gss serve`` passes).
* After the runner loads the model (``load_model``), `install` gives the decoder layer of each
  artifact's block the steered subclass of `gss.serving.vllm_op` (its forward calls the op
  ``gss::vllm_steer``). This is done before vLLM's warm-up, so torch.compile traces the op into
  its graph, and the steered layers are written into ``additional_config``, which keys vLLM's
  compile cache.
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
* An artifact calibrated on another model is refused when the steer is installed: its
  fingerprint against vLLM's config, embeddings and block weights (`_check_artifact`), the
  latter sampled as vLLM loads them (``process_weights_after_loading``), before its CPU build
  repacks them out of reach (`gss.serving.vllm_weights`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gss.serving import vllm_op, vllm_weights
from gss.serving.vllm_settings import (
    CONFIG_KEY,
    DEFAULT_ENV,
    DEFAULT_KEY,
    ENV,
    EXTRA_ARG,
    NO_STEER,
    OPT_OUT_ENV,
    OPT_OUT_KEY,
    PLUGIN_NAME,
    TRITON_ENV,
    V2_ENV,
    artifact_paths,
    check_names,
    configure,
    default_name,
    opt_out_allowed,
    opt_out_message,
    steer_name,
    unknown_name_message,
)

__all__ = [  # the settings too, where the plugin's first users found them
    "CONFIG_KEY",
    "DEFAULT_ENV",
    "DEFAULT_KEY",
    "ENV",
    "EXTRA_ARG",
    "NO_STEER",
    "OPT_OUT_ENV",
    "OPT_OUT_KEY",
    "PLUGIN_NAME",
    "TRITON_ENV",
    "V2_ENV",
    "artifact_paths",
    "check_names",
    "configure",
    "default_name",
    "forget_batch",
    "install",
    "missing_hooks",
    "opt_out_allowed",
    "register",
    "steer_name",
    "unknown_name_message",
    "unsupported_layout",
    "untested_runner",
]

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
# where vLLM's model loaders post-process the loaded weights (the CPU build repacks them)
_LOADER_MODULE = "vllm.model_executor.model_loader.base_loader"
_PATCHED_MODULES = (
    *_RUNNER_MODULES,
    _REQUEST_MODULE,
    _INPUT_MODULE,
    _V2_RUNNER_MODULE,
    _LOADER_MODULE,
)


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
    """The artifact's model fingerprint against the vLLM model, where it can be read: the
    config's shapes, the input embeddings and, where vLLM's layers hold them as transformers'
    tensors (`gss.serving.vllm_weights`), the block weights, so another fine-tune of the same
    base is refused as `SteeringArtifact.check_model` refuses it; with no block tensor
    readable, the shapes and embeddings alone."""
    from gss.artifact.fingerprint import (
        config_fingerprint,
        embedding_sample,
        fingerprint_differences,
    )
    from gss.errors import GSSError

    expected = art.provenance.fingerprint
    actual: dict[str, Any] = {**config_fingerprint(hf_config), "embedding_sample": []}
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    vocab = actual["vocab_size"]
    if isinstance(weight, Tensor) and vocab and weight.shape[0] >= vocab:  # not sharded
        actual["embedding_sample"] = embedding_sample(weight[:vocab].detach())
    blocks = _block_weights(model, hf_config)
    if any(blocks):
        actual["block_weights"] = blocks
    diffs = fingerprint_differences(expected, actual) if expected else []
    if diffs:
        raise GSSError(
            "a gss artifact was calibrated for another model than the one vLLM serves: "
            + "; ".join(diffs)
        )


def _block_weights(model: nn.Module, hf_config: Any) -> list[dict[str, list[float]]]:
    """The fingerprint's ``block_weights`` as vLLM's decoder layers hold them (empty where
    the layers are not found or their architecture is not mapped)."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    try:
        layers = _decoder_layers(model, int(text.num_hidden_layers))
    except (RuntimeError, AttributeError, TypeError):
        return []
    return vllm_weights.vllm_block_weights(layers, hf_config)


_recording = False  # True while a runner that serves artifacts loads its model


@contextlib.contextmanager
def _record_weights_of(runner: Any) -> Any:
    """While ``runner`` loads its model, sample its block weights as loaded
    (`_patch_loader_module`), where it serves artifacts."""
    global _recording
    _recording = bool(artifact_paths(runner.vllm_config))
    try:
        yield
    finally:
        _recording = False


def _record_block_weights(model: nn.Module, model_config: Any) -> None:
    """Keep a sample of the just-loaded block weights on vLLM's layers (`vllm_weights.record`)
    for `_check_artifact`: vLLM's CPU build repacks its linear weights next, leaving them empty."""
    hf_config = model_config.hf_config
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    try:
        layers = _decoder_layers(model, int(text.num_hidden_layers))
    except (RuntimeError, AttributeError, TypeError):
        return
    vllm_weights.record(layers, hf_config)


def _patch_loader_module(module: ModuleType) -> None:
    """Sample the block weights between vLLM's loading them and post-processing them
    (``process_weights_after_loading``, as its base loader calls it), while a runner that
    serves artifacts loads its model."""
    original = module.__dict__.get("process_weights_after_loading")
    if original is None or getattr(original, "_gss_hook", False):
        return

    def process_weights_after_loading(
        model: nn.Module, model_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if _recording:
            _record_block_weights(model, model_config)
        return original(model, model_config, *args, **kwargs)

    process_weights_after_loading._gss_hook = True  # type: ignore[attr-defined]
    setattr(module, "process_weights_after_loading", process_weights_after_loading)  # noqa: B010


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
    state = vllm_op.STATE  # the process's state, read once here
    state.load(paths, default, opt_out_allowed(runner.vllm_config))
    hf_config = runner.model_config.hf_config
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    layers = _decoder_layers(model, int(text.num_hidden_layers))
    for layer, entries in state.by_layer.items():
        for _, hook in entries:
            _check_artifact(hook.origin, model, hf_config)
        block = layers[layer]
        if type(block).__name__ == "PPMissingLayer":  # another pipeline rank holds it
            continue
        if not hasattr(block, "_gss_layer"):
            block.__class__ = vllm_op.steered_class(type(block))
            block._gss_layer = layer  # type: ignore[assignment]
    _mark_compile_key(runner.vllm_config)
    dtype = getattr(runner.model_config, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = next(model.parameters()).dtype
    state.prepare(runner.device, dtype, int(getattr(runner, "max_num_tokens", 1)))
    model._gss_installed = True
    from vllm.logger import init_logger

    logger = init_logger("vllm.gss")
    logger.info(
        "gss steers decoder layer(s) %s for the artifact(s) %s (SamplingParams.extra_args / "
        "vllm_xargs {%r: name}); a request naming none: %s; the steer runs as %s",
        sorted(state.by_layer),
        {name: paths[name] for name in sorted(state.names)},
        EXTRA_ARG,
        "not steered" if default is None else f"steered by {default!r} ({NO_STEER!r} opts out)",
        vllm_op.steer_kernels(),
    )
    untested = untested_runner(runner)
    if untested:
        logger.warning(untested)
    return True


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
    from gss._version import __version__

    state = vllm_op.STATE
    mark = {
        "version": __version__,
        # a graph compiled against another signature of the op must not be reused
        "op": str(torch.ops.gss.vllm_steer.default._schema),
        "layers": sorted(state.by_layer),
        "names": sorted(state.names),
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
    state = vllm_op.STATE  # one lookup a step (benchmarks and tests swap it)
    key = (tuple(ids), starts.tobytes())
    if key == state.batch:
        return
    per_token = np.repeat(per_request(), np.diff(starts))
    state.write(per_token, int(getattr(runner, "max_num_tokens", 1)), runner.device)
    state.batch = key


def forget_batch() -> None:
    """A request came or went: the next step looks its requests' slots up again, even where
    its request ids and token counts equal the last step's (vLLM takes an aborted request's id
    back for a new request)."""
    vllm_op.STATE.batch = None


def _request_slot(request: Any) -> int:
    """The slot of a runner's request (its ``CachedRequestState``), looked up from its sampling
    parameters and kept on it for its later steps: a request's artifact does not change, and
    looking it up on every step made the fill 1.2-2.5x slower at 16-256 requests
    (`benchmarks/scripts/vllm_fill_slots.py`)."""
    slot: int | None = getattr(request, "_gss_slot", None)
    if slot is None:
        slot = vllm_op.STATE.slot_of(request.sampling_params)
        with contextlib.suppress(AttributeError):  # a state that takes no new attribute
            request._gss_slot = slot
    return slot


def _patch_runner_class(cls: type) -> None:
    if cls.__dict__.get("_gss_patched"):
        return
    if "load_model" in cls.__dict__:
        load_model = cls.__dict__["load_model"]

        def patched_load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _record_weights_of(self):
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
            vllm_op.STATE.clear()
            return dummy_run(self, *args, **kwargs)

        setattr(cls, "_dummy_run", patched_dummy_run)  # noqa: B010
    setattr(cls, "_gss_patched", True)  # noqa: B010


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
        config = getattr(self, "vllm_config", None)
        if name == NO_STEER:
            default = default_name(config)
            if default is not None and not opt_out_allowed(config):
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(
                    opt_out_message(default), parameter="vllm_xargs", value=name
                )
        if name is not None and name != NO_STEER:
            names = getattr(self, "_gss_names", None)
            if names is None:
                names = frozenset(artifact_paths(config))
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
    if module.__name__ == _LOADER_MODULE:
        _patch_loader_module(module)
        return
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
        with _record_weights_of(self):
            result = original["load_model"](self, *args, **kwargs)
        install(self)
        return result

    def add_requests(self: Any, scheduler_output: Any) -> Any:
        result = original["add_requests"](self, scheduler_output)
        if getattr(self.model, "_gss_installed", False):
            slots = self.__dict__.setdefault("_gss_slots", {})
            for new in scheduler_output.scheduled_new_reqs:
                slots[new.req_id] = vllm_op.STATE.slot_of(new.sampling_params)
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
            vllm_op.STATE.clear()
        return original["execute_model"](self, *args, **kwargs)

    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_op.STATE.clear()  # V2's CUDA-graph capture calls the model itself, with dummy batches
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
