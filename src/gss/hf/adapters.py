"""The reference a PEFT (LoRA, ...) fine-tune already holds: its base model, adapters off.

A model fine-tuned with adapters was tuned from the base model whose weights sit under the
adapters, and that base is the reference the memorization signal wants. `adapters_off(model)`
returns a module that runs `model` with its adapters switched off for the length of each call,
so calibration, the signal and the layer scan need no second copy of the weights: half the
memory of loading the base again, which matters most for the large models adapters are used
on. Both kinds of adapter models are supported: a ``peft.PeftModel`` and a transformers model
with adapters loaded (``model.load_adapter`` / ``add_adapter``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, cast

from torch import Tensor, nn

from gss.errors import GSSError

# what else stands still while the base model runs: `gss.steering.attach` adds the pause of the
# steers on the blocks the base shares with the fine-tune (`steers_paused`) when it is imported,
# so this floor imports nothing above it; with steering never imported no steer is attached
PAUSES: list[Callable[[nn.Module], AbstractContextManager[None]]] = []


def _switch(model: nn.Module) -> Callable[[], AbstractContextManager[None]]:
    """A context manager factory that switches `model`'s adapters off, or a clear error."""
    disable_adapter = getattr(model, "disable_adapter", None)  # peft.PeftModel
    if callable(disable_adapter) and hasattr(model, "peft_config"):
        return cast(Callable[[], AbstractContextManager[None]], disable_adapter)
    if getattr(model, "_hf_peft_config_loaded", False):  # transformers' adapter integration
        return lambda: _tuner_layers_off(model)
    raise GSSError(
        f"adapters_off needs a model with adapters (a peft.PeftModel, or a transformers model "
        f"after load_adapter/add_adapter), got a plain {type(model).__name__}. Pass the model it "
        "was fine-tuned from as the reference instead."
    )


@contextmanager
def _tuner_layers_off(model: nn.Module) -> Iterator[None]:
    """Switch off the adapter layers of a transformers model with adapters loaded, and put
    each layer back as it was: its switch and its weights' ``requires_grad``.

    What transformers' ``disable_adapters``/``enable_adapters`` do, done here because
    transformers 5.24 refuses both unless peft >= 0.22.0 is installed, and the newest peft on
    the package index here (November 2026) is 0.21.2. Its ``enable_adapters`` also leaves
    "modules to save" switched off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils import ModulesToSaveWrapper

        kinds: tuple[type, ...] = (BaseTunerLayer, ModulesToSaveWrapper)
    except ImportError:
        kinds = (BaseTunerLayer,)
    layers: list[Any] = [m for m in model.modules() if isinstance(m, kinds)]
    was_off = [bool(getattr(m, "disable_adapters", False)) for m in layers]
    grads = [[p.requires_grad for p in m.parameters()] for m in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer, off, flags in zip(layers, was_off, grads, strict=True):
            layer.enable_adapters(not off)  # peft sets requires_grad here: put it back
            for p, flag in zip(layer.parameters(), flags, strict=True):
                p.requires_grad_(flag)


class AdaptersOff(nn.Module):
    """`model` with its adapters switched off for each call; the weights are `model`'s own.

    Moving or freezing this module moves or freezes `model`: they are one set of weights.
    Its train/eval mode is `model`'s (``train``/``eval`` here do not reach `model`).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._off = _switch(model)
        self.model = model
        self.training = model.training

    def train(self, mode: bool = True) -> AdaptersOff:
        # The wrapped model's train/eval mode belongs to its owner: passing the mode down would
        # let code that restores this wrapper's mode (calibration does, after the model's)
        # leave the model in another one. It runs in whatever mode the model is in.
        self.training = mode
        return self

    @property
    def config(self) -> Any:
        return getattr(self.model, "config", None)

    def get_input_embeddings(self) -> nn.Module:
        return cast(Callable[[], nn.Module], self.model.get_input_embeddings)()

    def get_output_embeddings(self) -> nn.Module | None:
        get = getattr(self.model, "get_output_embeddings", None)
        return get() if callable(get) else None

    def get_base_model(self) -> nn.Module:
        """The model the call reaches (peft's name for it): `gss.hf.forward.cache_argument`
        reads its forward to pass the KV cache under the name it takes."""
        unwrap = getattr(self.model, "get_base_model", None)
        return cast(nn.Module, unwrap()) if callable(unwrap) else self.model

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        # the base model: no adapters, and no steer attached to the blocks it shares
        with self._off(), ExitStack() as paused:
            for pause in PAUSES:
                paused.enter_context(pause(self.model))
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def adapters_off(model: nn.Module) -> AdaptersOff:
    """The reference of an adapter fine-tune without a second copy of its weights.

    Example::

        from peft import PeftModel
        model = PeftModel.from_pretrained(base, "my-lora")  # base: the model it was tuned from
        artifact = gss.calibrate(model, gss.adapters_off(model), texts, tokenizer=tok, layer=12)
        with gss.steer(model, artifact):
            ...

    Raises GSSError when `model` has no adapters to switch off.
    """
    return AdaptersOff(model)
