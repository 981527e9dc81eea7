"""Model forward passes that are exact under left or right padding.

Many architectures derive positions from the call (``arange``) rather than from the attention
mask, so a left-padded row would see shifted positions. Passing ``position_ids`` computed from
the mask makes a padded row score exactly like the same row alone.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from gss.errors import GSSError, GSSWarning
from gss.hf.blocks import text_configs


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """0-based positions counting only real tokens; padding positions get 0 (any value works)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp_min(0)


def accepts_position_ids(model: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def cache_argument(model: nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache under: ``cache`` from transformers 5.24
    on (which deprecates ``past_key_values``, warning on every use), else ``past_key_values``.
    A wrapper (a peft model) is asked for the model it wraps."""
    unwrap = getattr(model, "get_base_model", None)
    inner = unwrap() if callable(unwrap) else model
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned, read under the name that does not warn (``cache`` from
    transformers 5.24 on, ``past_key_values`` before)."""
    if "cache" in getattr(output, "__dataclass_fields__", {}):  # the old name is an alias there
        return output.cache
    return getattr(output, "past_key_values", None)


def _placed_device(module: nn.Module) -> torch.device | None:
    """Where ``module`` computes: its ``accelerate`` dispatch hook's execution device (an
    offloaded module keeps its weights on "meta" between calls), else its first weight that is
    not on "meta"; None if neither says."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def model_device(model: nn.Module) -> torch.device:
    """Device of the input embeddings (where input ids must go), also under a device_map:
    with a GPU, accelerate offloads the modules mapped to "cpu" and runs them on the GPU."""
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    found = _placed_device(emb) if isinstance(emb, nn.Module) else None
    return found or _placed_device(model) or next(model.parameters()).device


def execution_device(model: nn.Module, block: nn.Module) -> torch.device:
    """Where ``block`` computes, also when it is offloaded under an ``accelerate`` device_map."""
    return _placed_device(block) or model_device(model)


def input_embedding_weight(model: nn.Module) -> Tensor:
    """The (vocab, d) input embedding matrix of a transformers model."""
    # nn.Module.__getattr__ types both lookups as `Tensor | Module`
    get_emb = cast(Callable[[], nn.Module], model.get_input_embeddings)
    return cast(Tensor, get_emb().weight)


def input_embedding_values(model: nn.Module) -> Tensor:
    """The input embedding matrix with its values: under an ``accelerate`` device_map that
    offloads the embeddings (to "cpu" beside a GPU, or to "disk"), the module's weight is on
    "meta" between calls and the values sit in its dispatch hook's weights map."""
    weight = input_embedding_weight(model)
    if weight.device.type != "meta":
        return weight
    get_emb = cast(Callable[[], nn.Module], model.get_input_embeddings)
    weights_map = getattr(getattr(get_emb(), "_hf_hook", None), "weights_map", None)
    if weights_map is None:
        raise GSSError(
            "the model's input embeddings are on the meta device with no offloaded copy to "
            "read: load the model's weights (from_pretrained, or accelerate's "
            "load_checkpoint_and_dispatch) before calibrating or attaching."
        )
    return cast(Tensor, weights_map["weight"])


def vocab_size(model: nn.Module) -> int:
    """Number of logits the model produces."""
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if size is None:
        raise GSSError(
            f"cannot tell the vocabulary size of {type(model).__name__}: it has neither output "
            "embeddings (get_output_embeddings()) nor a config with vocab_size. Give it one of "
            "the two."
        )
    return int(size)


def _offloads(module: nn.Module) -> bool:
    """Whether ``module`` has an ``accelerate`` hook that keeps its weights elsewhere (cpu or
    disk) and brings them in for each call: its parameters on "meta" are then loaded."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([] if hook is None else [hook])  # SequentialHook
    return any(getattr(h, "weights_map", None) is not None for h in hooks)


def check_loaded(model: nn.Module, what: str = "model") -> None:
    """Refuse a model with a parameter on the "meta" device that no ``accelerate`` hook loads
    (``from_config`` under ``torch.device("meta")``, ``init_empty_weights()``, a
    ``device_map`` that left weights unloaded): its forward would fail deep inside torch, or
    compute on shapes alone. Offloaded modules (a ``device_map`` with "cpu" or "disk" beside
    a GPU) are loaded: their weights sit on "meta" between calls."""
    offloaded: list[str] = []
    for name, module in model.named_modules():
        if _offloads(module):
            offloaded.append(name + ".")
        for p_name, param in module.named_parameters(recurse=False):
            if param.device.type != "meta" or any(
                (name + ".").startswith(prefix) for prefix in offloaded
            ):
                continue
            where = f"{name}.{p_name}" if name else p_name
            raise GSSError(
                f"the {what}'s weights are on the meta device, not loaded ({where}, and maybe "
                "more): load it with from_pretrained (without device_map='meta' or "
                "init_empty_weights), or give a model built on meta real weights with "
                ".to_empty(device=...) and load_state_dict(...) before passing it to gss."
            )


def check_models(model: Any, *reference: Any) -> None:
    """Refuse a model (or the reference, when one is passed: None too) that is not a torch
    module, e.g. a path not yet loaded, or whose weights are not loaded (`check_loaded`)."""
    for what, m in (("model", model), *(("reference", r) for r in reference)):
        if not isinstance(m, nn.Module):
            raise GSSError(
                f"the {what} must be a torch.nn.Module (a causal LM), got {type(m).__name__}: "
                "load it first, e.g. gss.hf.loading.load_model(path) or "
                "AutoModelForCausalLM.from_pretrained(path)."
            )
        check_loaded(m, what)


def check_same_vocab(model: nn.Module, reference: nn.Module, tokenizer: Any = None) -> int | None:
    """Refuse a reference that cannot score the model's token ids; return the logit count both
    share where their counts differ (None where they do not): log-probabilities are taken over
    it, so that padded rows, which only one model has, take no probability from its tokens.

    Both must give a log-probability to every id the tokenizer makes. Their logit counts may
    differ where one pads its embedding matrix past the tokenizer (``resize_token_embeddings(
    pad_to_multiple_of=...)``, common and harmless): with the ``tokenizer`` given, that is
    accepted when the tokenizer's ids fit both. Without it, differing sizes cannot be told
    from a reference with another tokenizer, and are refused.
    """
    check_models(model, reference)
    a, b = vocab_size(model), vocab_size(reference)
    if a == b:
        return None
    words = len(tokenizer) if callable(tokenizer) and hasattr(tokenizer, "__len__") else None
    if words is None:
        raise GSSError(
            f"the model's vocabulary has {a} logits but the reference's has {b}: the memorization "
            "signal compares both models' log-probabilities of the same ids. If one of them only "
            "pads its embeddings past the tokenizer (resize_token_embeddings(pad_to_multiple_of="
            "...)), pass tokenizer=... (the gss command always does) so that gss can check that "
            "both cover its ids; otherwise the reference has another tokenizer: use a reference "
            "of the same base model (the model the fine-tune started from)."
        )
    if words > min(a, b):
        who = "reference" if b < a else "model"
        raise GSSError(
            f"the tokenizer has {words} tokens but the {who} has only {min(a, b)} logits (the "
            f"model {a}, the reference {b}): ids {min(a, b)} to {words - 1} have no "
            "log-probability there, so omega is undefined on them. Use as reference the model "
            "the fine-tune started from, with the tokens the fine-tune added "
            "(resize_token_embeddings(len(tokenizer)))."
        )
    return min(a, b)


def warn_if_foreign_tokenizer(model: nn.Module, tokenizer: Any) -> None:
    """Warn when ``tokenizer`` does not look like ``model``'s: another end-of-sequence id than
    its config's, or fewer than half as many tokens as it has logits. Text encoded with another
    model's tokenizer is other ids, on which nothing reads as memorized (an audit then reports
    0 rows where the model's own tokenizer finds them all)."""
    if tokenizer is None or not hasattr(tokenizer, "__len__"):
        return
    config = getattr(model, "config", None)
    wanted = getattr(config, "eos_token_id", None)
    listed = wanted if isinstance(wanted, (list, tuple)) else [wanted]
    wanted_ids = {int(i) for i in listed if isinstance(i, int)}
    eos = getattr(tokenizer, "eos_token_id", None)
    logits = vocab_size(model)
    odd = []
    if wanted_ids and isinstance(eos, int) and eos not in wanted_ids:
        odd.append(f"its end-of-sequence id is {eos}, the model's {sorted(wanted_ids)}")
    if isinstance(logits, int) and 0 < len(tokenizer) < logits / 2:
        odd.append(f"it has {len(tokenizer)} tokens for the model's {logits} logits")
    if odd:
        warnings.warn(
            f"the tokenizer does not look like the model's ({'; '.join(odd)}): text encoded "
            "with another model's tokenizer gives other ids, and the results would be about "
            "them. Pass the model's own tokenizer.",
            GSSWarning,
            stacklevel=3,
        )


def _token_id_limit(model: nn.Module) -> int | None:
    """One past the largest id `model` takes: its logits, or its input embedding's rows if
    fewer (a model may pad either); None for a model that tells neither."""
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    rows = getattr(getattr(emb, "weight", None), "shape", None)
    try:
        size = vocab_size(model)
    except GSSError:
        return int(rows[0]) if rows else None
    return min(size, int(rows[0])) if rows else size


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


# RoPE scalings that stretch the positions a config's max_position_embeddings names by `factor`
# (its value stays the pretrained length); others ("llama3", "longrope") set the stretched
# length there themselves, keeping the pretrained one in original_max_position_embeddings
STRETCHING_ROPE = ("linear", "dynamic", "yarn")


def _rope_stretch(config: Any, length: int) -> float:
    """The factor by which `config`'s RoPE scaling stretches `length` positions (1: none)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(config, key, None)
        if not isinstance(params, dict):
            continue
        per_layer_type = [v for v in params.values() if isinstance(v, dict)]
        for p in per_layer_type or [params]:
            kind, factor = p.get("rope_type", p.get("type")), p.get("factor")
            original = p.get("original_max_position_embeddings", length)
            if kind in STRETCHING_ROPE and isinstance(factor, (int, float)) and original >= length:
                return max(float(factor), 1.0)
    return 1.0


def context_length(model: nn.Module) -> tuple[int, str] | None:
    """The most positions `model` takes and the config key that says so (times the RoPE
    scaling factor where one stretches it); None where its config sets no limit (a
    state-space model)."""
    for config in text_configs(model):
        for name in CONTEXT_KEYS:
            value = getattr(config, name, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value <= 0:
                return None
            stretch = _rope_stretch(config, value)
            if stretch > 1:
                return int(value * stretch), f"{name} x RoPE scaling factor {stretch:g}"
            return value, name
    return None


def check_sequences(
    models: Sequence[nn.Module],
    seqs: Sequence[Sequence[int] | Tensor] | Tensor,
    what: str,
    new_tokens: int = 0,
) -> None:
    """Refuse sequences `models` cannot run before a forward pass fails on them deep inside
    torch (on a GPU, with an assert that leaves the device unusable until the process ends):
    token ids they have no embedding row or logit for, and sequences longer than their
    context (learned position embeddings index past their end; rotary ones run on positions
    never trained), counting the `new_tokens` to be generated after each. A model that tells
    neither (a stand-in in tests) sets no bound."""
    if isinstance(seqs, Tensor):
        rows: Sequence[Sequence[int] | Tensor] = list(seqs) if seqs.numel() else []
    else:
        rows = [r for r in seqs if len(r)]
    if not rows:
        return
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    for model in models:
        found = context_length(model)
        if found is not None and len(rows[longest]) + new_tokens > found[0]:
            limit, where = found
            if new_tokens:
                raise GSSError(
                    f"{what}: sequence {longest} has {len(rows[longest])} tokens, and "
                    f"{new_tokens} more to generate make {len(rows[longest]) + new_tokens}, more "
                    f"than the {limit} positions the model takes (config.{where}): shorten it or "
                    "generate fewer tokens (max_new_tokens=, --max-new-tokens)."
                )
            raise GSSError(
                f"{what}: sequence {longest} has {len(rows[longest])} tokens, more than the "
                f"{limit} positions the model takes (config.{where}). Cut the sequences with "
                f"max_length={limit} or less (--max-length on the command line) or split long "
                "texts."
            )
    check_vocabulary(models, rows, what)


def check_vocabulary(
    models: Sequence[nn.Module], rows: Sequence[Sequence[int] | Tensor], what: str
) -> None:
    """Refuse ids `models` have no rows for (another tokenizer's, negative padding)."""
    rows = [r for r in rows if len(r)]
    limits = [n for n in map(_token_id_limit, models) if n is not None]
    if not limits or not rows:
        return
    tensors = [r if isinstance(r, Tensor) else torch.as_tensor(r) for r in rows]
    low = min(int(t.min()) for t in tensors)
    high = max(int(t.max()) for t in tensors)
    limit = min(limits)
    if low >= 0 and high < limit:
        return
    bad = low if low < 0 else high
    raise GSSError(
        f"{what}: token id {bad} is outside the model's vocabulary (ids 0 to {limit - 1}). "
        "Such ids come from another tokenizer, or from padding marked with a negative id. "
        "Tokenize with the model's own tokenizer (or pass the strings and tokenizer=...), and "
        "mark padding with attention_mask."
    )


def accepts(model: nn.Module, name: str) -> bool:
    """Whether `model`'s forward takes the keyword `name` (by name, or through ``**kwargs``);
    True when its signature cannot be read."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def output_logits(output: Any) -> Tensor:
    """The logits of what a forward returned: a transformers output's ``.logits``, the first
    item of a tuple (``return_dict=False``), or the output itself when it is a tensor (a
    plain `nn.Module` language model)."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, Tensor):
        raise GSSError(
            f"the model's forward returned a {type(output).__name__} without logits: gss reads "
            "the logits as the output's .logits (transformers models) or as the output itself "
            "(a (batch, seq, vocab) tensor)."
        )
    return logits


def forward_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Logits (B, T, V) of a forward pass with mask-derived positions, no KV cache.

    A forward that takes no ``attention_mask`` runs without it on right-padded rows (a causal
    model's real tokens never see the padding after them); other padding is refused."""
    device = model_device(model)
    mask = attention_mask.to(device)
    kwargs: dict[str, Any] = {"input_ids": input_ids.to(device)}
    if accepts(model, "attention_mask"):
        kwargs["attention_mask"] = mask
    elif bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise GSSError(
            "the model's forward takes no attention_mask, so it would read the padding before "
            "a row's tokens: pad the rows on the right, or give its forward an attention_mask."
        )
    if accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    if accepts_position_ids(model):
        kwargs["position_ids"] = position_ids_from_mask(mask)
    logits = output_logits(model(**kwargs))
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise GSSError(
            f"the model's forward returned logits of shape {tuple(logits.shape)} for input_ids "
            f"of shape {tuple(input_ids.shape)}: gss needs (batch, seq, vocab) logits, the "
            "next-token scores at every position."
        )
    return logits


def target_mask(attention_mask: Tensor) -> Tensor:
    """(B, T-1) mask of next-token targets that have a real token and a real context."""
    m = attention_mask.bool()
    return m[:, 1:] & m[:, :-1]


def token_logprobs(logits: Tensor, input_ids: Tensor, vocab: int | None = None) -> Tensor:
    """float32 log p(x_t | x_<t) for t = 1..T-1, shape (B, T-1), normalised over the first
    ``vocab`` logits (default: all; `check_same_vocab` says how many two models share)."""
    logp = torch.log_softmax(logits[:, :-1, :vocab].float(), dim=-1)
    targets = input_ids[:, 1:].to(logp.device)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
