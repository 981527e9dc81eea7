"""Find the decoder blocks of a Hugging Face decoder-only model.

Layer ``L`` always means *the output of decoder block L* (0-based), the residual stream that
leaves the block. Calibration reads that tensor and the steering hook rewrites that same tensor,
so the two can never disagree about where they act.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gss.errors import GSSError

# Attribute paths of the block list in common architectures, tried in order.
KNOWN_BLOCK_PATHS: tuple[str, ...] = (
    "model.layers",  # Llama, Mistral, Qwen2/3, Gemma, Phi-3, SmolLM
    "transformer.h",  # GPT-2, GPT-J, GPT-Neo, Falcon, BLOOM
    "gpt_neox.layers",  # Pythia / GPT-NeoX
    "model.decoder.layers",  # OPT
    "model.language_model.layers",  # the text model of a vision-language model (Gemma 3)
    "language_model.model.layers",  # the same in transformers 4
    "transformer.blocks",  # MPT
    "transformer.layers",
    "model.transformer.h",
    "layers",
    "h",
)

# Wrappers (PEFT, DDP, compile) keep the real model one or more attributes down.
_WRAPPER_ATTRS: tuple[str, ...] = ("_orig_mod", "module", "base_model", "model")


def _get_path(root: nn.Module, path: str) -> nn.Module | None:
    obj: object = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def text_configs(model: nn.Module) -> Iterator[Any]:
    """The (text) configs of the model and of the models it wraps, outermost first."""
    for candidate in _unwrap(model):
        config = getattr(candidate, "config", None)
        text_config = getattr(config, "get_text_config", None)
        if callable(text_config):
            config = text_config()
        if config is not None:
            yield config


def config_int(model: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first of `names` that the (text) config of the model, or of a model it wraps, sets
    to an int."""
    for config in text_configs(model):
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _num_layers(model: nn.Module) -> int | None:
    return config_int(model, ("num_hidden_layers", "n_layer", "num_layers"))


def residual_width(model: nn.Module) -> int:
    """Width d of the residual stream that leaves the decoder blocks (what calibration reads and
    the steer rewrites): the config's hidden size, else the input embeddings' width. The two
    differ where the embeddings are projected in, e.g. OPT-350m (512-wide embeddings, 1024-wide
    blocks)."""
    width = config_int(model, ("hidden_size", "n_embd", "d_model"))
    if width is not None:
        return width
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    weight = getattr(emb, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise GSSError(
            f"cannot tell the hidden size of {type(model).__name__}: its config sets none of "
            "hidden_size, n_embd or d_model and it has no input embedding matrix. Give the "
            "model a transformers config with hidden_size."
        )
    return int(weight.shape[1])


def _unwrap(model: nn.Module) -> list[nn.Module]:
    """The model and the models it wraps, outermost first."""
    chain = [model]
    seen = {id(model)}
    current = model
    while True:
        inner = None
        for attr in _WRAPPER_ATTRS:
            candidate = getattr(current, attr, None)
            # Only unwrap into a full model (it has a config) or torch's own wrappers.
            if (
                isinstance(candidate, nn.Module)
                and id(candidate) not in seen
                and (attr in ("_orig_mod", "module") or hasattr(candidate, "config"))
            ):
                inner = candidate
                break
        if inner is None:
            return chain
        chain.append(inner)
        seen.add(id(inner))
        current = inner


def find_decoder_blocks(model: nn.Module, path: str | None = None) -> nn.ModuleList:
    """Return the ModuleList of decoder blocks of ``model``.

    Order of search: an explicit ``path`` (dotted attribute path such as ``"model.layers"``),
    then known paths of common architectures, then a structural fallback (the one ModuleList
    whose length equals ``config.num_hidden_layers``). Wrapped models (PEFT, DDP,
    ``torch.compile``) are searched through.
    """
    if path is not None:
        found = _get_path(model, path)
        if not isinstance(found, nn.ModuleList):
            raise GSSError(
                f"block path {path!r} does not name a torch.nn.ModuleList in "
                f"{type(model).__name__}. Pass the dotted attribute path of the list of decoder "
                "blocks, e.g. 'model.layers' or 'transformer.h'."
            )
        return found

    expected = _num_layers(model)
    for candidate_model in _unwrap(model):
        for known in KNOWN_BLOCK_PATHS:
            found = _get_path(candidate_model, known)
            if (
                isinstance(found, nn.ModuleList)
                and len(found) > 0
                and (expected is None or len(found) == expected)
            ):
                return found

    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    if expected is not None:
        matching = [(n, m) for n, m in lists if len(m) == expected]
        # Keep the outermost matches (a block list, not a list nested inside one block).
        outer = [(n, m) for n, m in matching if not any(n.startswith(o + ".") for o, _ in matching)]
        if len(outer) == 1:
            return outer[0][1]
    candidates = ", ".join(f"{n} (len {len(m)})" for n, m in lists[:12]) or "none"
    raise GSSError(
        f"could not locate the decoder blocks of {type(model).__name__}"
        f" (config says {expected} layers). ModuleLists found: {candidates}. "
        "Name the list with block_path='<dotted.path.to.blocks>' (gss calibrate and gss layers: "
        "--block-path)."
    )


def resolve_layer(model: nn.Module, layer: int, path: str | None = None) -> tuple[int, nn.Module]:
    """Normalise a (possibly negative) block index and return ``(index, block)``."""
    blocks = find_decoder_blocks(model, path)
    n = len(blocks)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise GSSError(f"layer must be an int block index, got {layer!r}.")
    if not -n <= layer < n:
        raise GSSError(
            f"layer {layer} is out of range: the model has {n} decoder blocks, so valid layers "
            f"are 0..{n - 1} (or -{n}..-1 counting from the end)."
        )
    index = layer % n
    return index, blocks[index]
