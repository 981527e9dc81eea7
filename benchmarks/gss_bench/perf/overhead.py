"""Inference overhead: greedy ``generate`` tokens/s with the gated steer attached vs without.

The artifact comes from a real ``gss.calibrate`` run (the model against a slightly perturbed
copy of itself on random token ids), so probes, steers and thresholds have realistic shapes and
scales. The hook's cost does not depend on how often the gate opens (it computes every
response and masks, without branching), but the measured open share is reported anyway.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

import gss
from gss.hf.blocks import resolve_layer
from gss.hf.forward import model_device
from gss.hf.loading import load_causal_lm
from gss.report import markdown_table
from gss.steering.attach import register
from gss_bench.perf.common import (
    Sizes,
    interleaved,
    log,
    paired_ratios,
    perturbed_copy,
    random_ids,
    summary,
    sync,
    syncer,
    tiny_model,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _embedding_weight(model: nn.Module) -> torch.Tensor:
    """The ``(vocab, hidden)`` input embedding matrix of an HF model."""
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()
    return cast(torch.Tensor, embeddings.weight)


def _vocab(model: nn.Module) -> int:
    return int(_embedding_weight(model).shape[0])


def build_artifact(model: nn.Module, sizes: Sizes, rank: int) -> gss.SteeringArtifact:
    """Calibrate a rank-``rank`` steer at the middle block; the gates open on ~10% of tokens."""
    n_layers = len(gss.find_decoder_blocks(model))
    reference = perturbed_copy(model)
    # CPU ids, as a user passes them: calibrate moves each batch to the model's device
    ids = random_ids(sizes.artifact_texts, sizes.text_len, _vocab(model), seed=7)
    artifact = gss.calibrate(
        model,
        reference,
        ids,
        "gss",
        layer=n_layers // 2,
        rank=rank,
        gate_share=0.1,
        batch_size=8,
        progress=False,
    )
    del reference
    return artifact


def _generate(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    # greedy, no return_dict_in_generate: `generate` returns the token ids
    generate = cast(Callable[..., torch.Tensor], model.generate)
    with torch.no_grad():
        return generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


class _Peer:
    """The same steer applied through nnsight's intervention API (untimed when not installed)."""

    def __init__(self, model: nn.Module, artifact: gss.SteeringArtifact, tokenizer: Any) -> None:
        import nnsight

        wrapper = getattr(nnsight, "LanguageModel", None) or nnsight.TransformersModel
        with warnings.catch_warnings():  # its deprecation notices, once per call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.wrapped = wrapper(model, tokenizer=tokenizer)
        _, block = resolve_layer(model, artifact.layer, artifact.config.block_path)
        path = next(name for name, module in model.named_modules() if module is block)
        envoy: Any = self.wrapped
        for part in path.split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        self.envoy = envoy
        self.hook = artifact.make_hook()

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with warnings.catch_warnings():  # nnsight 0.8's own deprecation notices are not
            warnings.simplefilter("ignore")  # DeprecationWarning subclasses: mute them all
            return self._generate(inputs, new_tokens)

    def _generate(self, inputs: dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
        envoy, hook = self.envoy, self.hook
        with self.wrapped.generate(
            inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        ) as tracer:
            for _ in tracer.iter[:new_tokens]:
                out = envoy.output
                hidden = out[0] if isinstance(out, tuple) else out
                steered, _ = hook.steer_hidden(hidden)
                envoy.output = (steered, *out[1:]) if isinstance(out, tuple) else steered
            generated = self.wrapped.generator.output.save()
        return generated


def word_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``vocab`` ids, for wrappers that insist on a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2"
    )


class StepClock:
    """Times every decode step of ``generate``: forward pre/post hooks on the whole model.

    A step's median over all calls of an arm is robust to the spikes of this machine that move
    whole-call times by several percent; the prompt pass (each call's first forward) and the
    warm-up calls are left out. On CUDA each step is bracketed by a synchronize, so it starts
    after the work generate queued between steps and ends when its own kernels have run.
    """

    def __init__(self, model: nn.Module, warmup: int) -> None:
        self.warmup = warmup
        self._sync = syncer(model_device(model))
        self.steps: dict[str, list[float]] = {}
        self._calls: dict[str, int] = {}
        self._arm: str | None = None
        self._first = False
        self._start = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._pre),
            model.register_forward_hook(self._post),
        ]

    def arm(self, name: str, fn: Callable[[], float]) -> Callable[[], float]:
        """`fn` with its decode steps recorded under `name`."""

        def run() -> float:
            self._calls[name] = self._calls.get(name, 0) + 1
            self._arm = name if self._calls[name] > self.warmup else None
            self._first = True
            try:
                return fn()
            finally:
                self._arm = None

        return run

    def _pre(self, module: nn.Module, args: Any) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._sync()
        elapsed = time.perf_counter() - self._start
        if self._arm is not None and not self._first:
            self.steps.setdefault(self._arm, []).append(elapsed)
        self._first = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class AlternatingSteps:
    """Steers every other decode step of one ``generate`` call and times each step.

    The most precise read of what the steer costs a step: two neighbouring steps are a few
    milliseconds apart and share the host's state, so the drift and spikes that move whole
    calls by several percent on this machine cancel in their ratio. The steer is installed
    on the block as ``attach`` installs it (``gss.steering.attach.register``: a wrapped ``forward``)
    before a steered step's clock starts and removed before the next step (a forward pre-hook
    put ahead of every other), so toggling is not timed; which steps are
    steered flips from call to call, so each step position is steered in half the calls.
    """

    def __init__(self, model: nn.Module, block: nn.Module) -> None:
        self.block = block
        self._sync = syncer(model_device(model))
        self._hook: Callable[..., Any] | None = None
        self._install: Callable[[nn.Module, Callable[..., Any]], Any] = register
        self._handle: Any = None  # what install returned: anything with remove()
        self._step = 0
        self._parity = 0
        self._steered = False
        self._start = 0.0
        self.steps: dict[bool, list[float]] = {False: [], True: []}
        # the pre-hook first and the post-hook first, so the other hooks on the model (a
        # StepClock) run inside the span in both kinds of step alike
        self._handles = [
            model.register_forward_pre_hook(self._pre, prepend=True),
            model.register_forward_hook(self._post, prepend=True),
        ]

    def run(
        self,
        hook: Callable[..., Any],
        call: Callable[[], float],
        parity: int,
        install: Callable[[nn.Module, Callable[..., Any]], Any] = register,
    ) -> float:
        """Run ``call`` (one generate) with ``hook`` on every other decode step, put on the
        block by ``install`` (as ``attach`` does, or `as_forward_hook`); returns the call's
        median unsteered step over its median steered step."""
        self._hook, self._step, self._parity = hook, 0, parity % 2
        self._install = install
        self.steps = {False: [], True: []}
        try:
            call()
        finally:
            self._detach()
            self._hook = None
        if not (self.steps[False] and self.steps[True]):
            return math.nan  # a single decode step: nothing to pair
        return statistics.median(self.steps[False]) / statistics.median(self.steps[True])

    def _detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._hook is None:
            return
        self._detach()
        # step 0 is the prompt pass: never steered, never timed
        self._steered = self._step > 0 and (self._step + self._parity) % 2 == 1
        if self._steered:
            self._handle = self._install(self.block, self._hook)
        self._sync()
        self._start = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._hook is None:
            return
        self._sync()
        elapsed = time.perf_counter() - self._start
        if self._step > 0:
            self.steps[self._steered].append(elapsed)
        self._step += 1

    def remove(self) -> None:
        self._detach()
        for handle in self._handles:
            handle.remove()


AS_FORWARD_HOOK = "forward hook"  # the alternating arm that installs with as_forward_hook


def as_forward_hook(block: nn.Module, hook: Callable[..., Any]) -> Any:
    """Put ``hook`` on ``block`` as a forward hook, as gss did before it wrapped the block's
    ``forward``: the comparison arm that shows what the hook dispatch costs a step."""
    return block.register_forward_hook(hook, prepend=True)


def hook_seconds(
    model: nn.Module,
    artifact: gss.SteeringArtifact,
    batch: int,
    calls: int,
    rounds: int = 5,
) -> float:
    """Median seconds of one call of the steer's hook on a decode step's block output
    (batch x 1 token), timed alone: the part of the generate ratio that is ours, free of the
    whole-call noise."""
    _, block = resolve_layer(model, artifact.layer, artifact.config.block_path)
    hook = artifact.make_hook()  # what attach registers
    param = next(model.parameters())
    hidden = torch.randn(batch, 1, hook.hidden_size, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        for _ in range(calls // 10):
            hook(block, (), hidden)
        per_call = []
        for _ in range(rounds):
            sync(param.device)  # the warm-up's (or last round's) kernels are not this round's
            start = time.perf_counter()
            for _ in range(calls):
                hook(block, (), hidden)
            sync(param.device)
            per_call.append((time.perf_counter() - start) / calls)
    return summary(per_call)["median"]


def hook_seconds_in_generate(
    model: nn.Module,
    artifact: gss.SteeringArtifact,
    ids: torch.Tensor,
    new_tokens: int,
) -> float:
    """Median seconds of one call of the steer's hook on a decode step, inside real
    ``generate`` calls. On a CPU this is ~3x the call timed alone (a tiny model, 2 threads:
    ~35 against ~12 us): between two calls the model's other ops evict the caches the hook's
    three kernels and their dispatch ran from, so the loop alone understates what a step pays.
    On CUDA every call is bracketed by a synchronize: the block's queued kernels finish before
    the clock starts and the hook's own before it stops (which stalls the step, untimed)."""
    _, block = resolve_layer(model, artifact.layer, artifact.config.block_path)
    hook = artifact.make_hook()  # what attach registers
    spent: list[float] = []
    done = syncer(model_device(model))

    def timed(module: nn.Module, args: Any, output: Any) -> Any:
        done()
        start = time.perf_counter()
        out = hook(module, args, output)
        done()
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        if hidden.shape[1] == 1:  # decode steps only, not the prompt pass
            spent.append(time.perf_counter() - start)
        return out

    handle = block.register_forward_hook(timed)
    try:
        for _ in range(3):
            _generate(model, ids, new_tokens)
    finally:
        handle.remove()
    return summary(spent)["median"]


def nnsight_status() -> str:
    return "available" if importlib.util.find_spec("nnsight") is not None else "not installed"


def measure_model(
    name: str,
    model: nn.Module,
    sizes: Sizes,
    *,
    new_tokens: int,
    repeats: int,
    warmup: int,
    progress: bool,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Every (batch, K) row for one model, plus the peer when it is installed."""
    t0 = time.perf_counter()
    full = build_artifact(model, sizes, max(sizes.ranks))
    artifacts = {k: full.with_options(rank=k) for k in sizes.ranks}
    log(f"overhead/{name}: artifact calibrated in {time.perf_counter() - t0:.1f} s")
    _, block = resolve_layer(model, full.layer, full.config.block_path)
    peer: dict[str, Any] = {"library": "nnsight", "status": nnsight_status()}
    runner = None
    if peer["status"] == "available":
        try:
            tok = tokenizer if tokenizer is not None else word_tokenizer(_vocab(model))
            runner = _Peer(model, artifacts[sizes.peer_rank], tok)
            peer["rank"] = sizes.peer_rank
        except Exception as err:  # a peer's API drift must not sink the benchmark
            peer["status"] = f"failed to wrap: {type(err).__name__}: {err}"
    rows = []
    device = model_device(model)
    for batch in sizes.batch_sizes:
        ids = random_ids(batch, sizes.prompt_len, _vocab(model), seed=100 + batch).to(device)
        tokens = batch * new_tokens

        def plain(ids: torch.Tensor = ids) -> float:
            sync(device)  # nothing queued before the call counts towards it
            start = time.perf_counter()
            _generate(model, ids, new_tokens)
            sync(device)
            return time.perf_counter() - start

        def steered(art: gss.SteeringArtifact, ids: torch.Tensor = ids) -> float:
            with art.attach(model):
                return plain(ids)

        def noop(ids: torch.Tensor = ids) -> float:
            # the noise floor: a hook that does nothing, installed as a steer is
            handle = register(block, _noop_hook)
            try:
                return plain(ids)
            finally:
                handle.remove()

        # "unsteered again" is the A/A arm: the same call under a second name, whose ratio to
        # "unsteered" is what the measurement reads when nothing differs
        arms: dict[str, Callable[[], float]] = {
            "unsteered": plain,
            "unsteered again": plain,
            "no-op hook": noop,
        }
        for k, art in artifacts.items():
            arms[f"gss K={k}"] = partial(steered, art)
        peer_row: dict[str, Any] = {}
        if runner is not None:
            try:
                with artifacts[sizes.peer_rank].attach(model):
                    ours_ids = _generate(model, ids, new_tokens)
                theirs_ids = runner.generate(ids, new_tokens)
                peer_row["same_output"] = bool(torch.equal(ours_ids.cpu(), theirs_ids.cpu()))

                def peer_arm(ids: torch.Tensor = ids) -> float:
                    sync(device)
                    start = time.perf_counter()
                    runner.generate(ids, new_tokens)
                    sync(device)
                    return time.perf_counter() - start

                arms["nnsight"] = peer_arm
            except Exception as err:
                peer_row["error"] = f"{type(err).__name__}: {err}"
        clock = StepClock(model, warmup)
        alternating = AlternatingSteps(model, block)
        # (K or 0 for the no-op hook, how: "" as attach installs it or AS_FORWARD_HOOK) -> per
        # call: median unsteered step over median steered step, steps alternating in the call
        alternated: dict[tuple[int, str], list[float]] = defaultdict(list)

        def alternate(
            k: int,
            how: str,
            ids: torch.Tensor = ids,
            steps: AlternatingSteps = alternating,
            ratios: dict[tuple[int, str], list[float]] = alternated,
        ) -> float:
            calls = ratios[k, how]
            # a fresh hook each call, as attach makes: its first steered step is the checked one
            hook = artifacts[k].make_hook() if k else _noop_hook
            install = as_forward_hook if how == AS_FORWARD_HOOK else register
            calls.append(steps.run(hook, partial(plain, ids), len(calls), install))
            return 0.0  # timed by its steps, not as a whole call

        try:
            arms = {arm: clock.arm(arm, fn) for arm, fn in arms.items()}
            arms["no-op hook, alternating steps"] = partial(alternate, 0, "")
            for k in artifacts:
                arms[f"gss K={k}, alternating steps"] = partial(alternate, k, "")
                if k == sizes.peer_rank:
                    arms[f"gss K={k}, forward hook, alternating steps"] = partial(
                        alternate, k, AS_FORWARD_HOOK
                    )
            times = interleaved(arms, repeats, warmup, f"overhead {name} batch {batch}", progress)
        finally:
            clock.remove()
            alternating.remove()
        plain_steps = summary(clock.steps["unsteered"])
        base = times["unsteered"]
        plain_rate = summary([tokens / t for t in base])
        step = batch / plain_rate["median"]  # one unsteered decode step, from its tokens/s
        for k, art in artifacts.items():
            ours = times[f"gss K={k}"]
            with art.attach(model, track_gates=True) as handle:
                _generate(model, ids, new_tokens)
                gates = handle.gate_stats()
            ratios = paired_ratios(base, ours)  # tokens/s steered over tokens/s unsteered
            steered_steps = summary(clock.steps[f"gss K={k}"])
            hook_s = hook_seconds(model, art, batch, calls=sizes.hook_calls)
            hook_in_generate = hook_seconds_in_generate(model, art, ids, new_tokens)
            row: dict[str, Any] = {
                "model": name,
                "batch": batch,
                "rank": k,
                "new_tokens": new_tokens,
                "prompt_len": sizes.prompt_len,
                "tokens_per_s_unsteered": plain_rate,
                "tokens_per_s_steered": summary([tokens / t for t in ours]),
                "ratio": summary(ratios),
                # the same call as a second arm, and a hook that does nothing, timed the same
                # way: how far from 1 the ratio goes when nothing (or no work) differs
                "aa_ratio": summary(paired_ratios(base, times["unsteered again"])),
                "noop_over_unsteered": summary(paired_ratios(base, times["no-op hook"])),
                "gss_over_noop": summary(paired_ratios(times["no-op hook"], ours)),
                "gate_open_share": gates.get("any_open_share", 0.0),
                "decode_step_seconds": {"unsteered": plain_steps, "steered": steered_steps},
                "step_ratio": plain_steps["median"] / steered_steps["median"],
                "alternating_step_ratio": _alternated(alternated[k, ""], warmup),
                "alternating_noop_ratio": _alternated(alternated[0, ""], warmup),
                "hook_seconds_per_call": hook_s,
                "hook_seconds_in_generate": hook_in_generate,
                "hook_share_of_step": hook_in_generate / step,
                "seconds": {
                    "unsteered": base,
                    "unsteered again": times["unsteered again"],
                    "steered": ours,
                    "no-op hook": times["no-op hook"],
                },
            }
            if alternated[k, AS_FORWARD_HOOK]:
                row["alternating_step_ratio_forward_hook"] = _alternated(
                    alternated[k, AS_FORWARD_HOOK], warmup
                )
            if k == sizes.peer_rank and runner is not None:
                row["peer"] = dict(peer_row)
                if "nnsight" in times:
                    theirs_t = times["nnsight"]
                    row["peer"]["tokens_per_s"] = summary([tokens / t for t in theirs_t])
                    row["peer"]["ratio"] = summary(paired_ratios(base, theirs_t))
                    row["peer"]["gss_over_peer"] = summary(paired_ratios(theirs_t, ours))
                    row["peer"]["seconds"] = theirs_t
                    if clock.steps.get("nnsight"):
                        theirs_step = summary(clock.steps["nnsight"])["median"]
                        row["peer"]["step_ratio"] = plain_steps["median"] / theirs_step
            rows.append(row)
            log(
                f"overhead/{name} batch {batch} K={k}: "
                f"{row['tokens_per_s_steered']['median']:.1f} vs "
                f"{row['tokens_per_s_unsteered']['median']:.1f} tok/s, ratio "
                f"{row['ratio']['median']:.3f}"
            )
    config = getattr(model, "config", None)
    return {
        "model": name,
        "architecture": type(model).__name__,
        "hidden_size": int(_embedding_weight(model).shape[1]),
        "num_layers": len(gss.find_decoder_blocks(model)),
        "vocab_size": _vocab(model),
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "layer": full.config.layer,
        "repeats": repeats,
        "warmup": warmup,
        "artifact_gate_open_share": full.provenance.gate_open_share.get("union"),
        "peer": peer,
        "rows": rows,
    }


def has_weights(path: str | Path) -> bool:
    """Whether a model directory holds weight files (else only its config travelled)."""
    return any(any(Path(path).glob(pattern)) for pattern in ("*.safetensors", "*.bin"))


def load_local_model(
    path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[nn.Module, Any]:
    """A local HF model directory in ``dtype`` on ``device`` (never downloads), and its
    tokenizer if any. A directory with a ``config.json`` and no weight files gives that
    architecture with random weights (seeded), built on ``device``: speed does not depend on
    the weights, and a GPU machine can be sent a config where a checkpoint would not fit."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not Path(path).is_dir():
        raise SystemExit(f"gss bench perf: --model {path} is not a local model directory")
    loaded: nn.Module
    if has_weights(path) or not (Path(path) / "config.json").is_file():
        loaded = load_causal_lm(path, dtype)
    else:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        torch.manual_seed(0)
        with torch.device(device):
            loaded = AutoModelForCausalLM.from_config(config).to(dtype)
    model = loaded.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        tokenizer = None
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer


def model_name(path: str) -> str:
    """The name a ``--model`` directory's rows carry; random weights say so."""
    name = Path(path).name
    return name if has_weights(path) else f"{name} (random weights)"


def run(
    sizes: Sizes,
    *,
    model_paths: Sequence[str],
    repeats: int | None,
    new_tokens: int | None,
    progress: bool,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    models = [
        measure_model(
            "tiny-llama",
            tiny_model(sizes, device=device, dtype=dtype),
            sizes,
            new_tokens=new_tokens or sizes.new_tokens,
            repeats=repeats or sizes.overhead_repeats,
            warmup=sizes.warmup,
            progress=progress,
        )
    ]
    for model_path in model_paths:
        t0 = time.perf_counter()
        model, tokenizer = load_local_model(model_path, dtype=dtype, device=device)
        log(f"overhead: loaded {model_path} in {time.perf_counter() - t0:.1f} s")
        models.append(
            measure_model(
                model_name(model_path),
                model,
                sizes,
                new_tokens=new_tokens or sizes.model_new_tokens,
                repeats=repeats or sizes.model_repeats,
                warmup=sizes.model_warmup,
                progress=progress,
                tokenizer=tokenizer,
            )
        )
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the next model's room
    return {
        "method": (
            "greedy model.generate with min_new_tokens = max_new_tokens; tokens/s counts new "
            "tokens (batch x new_tokens) over the whole call including the prompt pass. Arms run "
            "interleaved after warm-up; ratio = median over rounds of (unsteered seconds / steered "
            "seconds), i.e. steered tokens/s over unsteered. hook_seconds_per_call: one call of "
            "the hook on a decode step's block output (batch x 1 x d), timed alone (median of 5 "
            "rounds); hook_seconds_in_generate: the same hook timed on every decode step of 3 "
            "generate calls (median), which is what a step pays; hook_share_of_step: that over one "
            "unsteered decode step (batch / median unsteered tokens/s). step_ratio: median "
            "unsteered decode-step seconds over median steered ones, every step of every timed "
            "call (forward hooks on the model; prompt passes and warm-up calls left out). "
            "aa_ratio: the unsteered call timed as a second arm (A/A), i.e. what the ratio reads "
            "when nothing differs; noop_over_unsteered: a hook that returns at once, installed on "
            "the same block as a steer is (a wrapped forward), timed as one more arm: how far from "
            "1 the ratio goes when nothing is computed; gss_over_noop: GSS over that arm. "
            "alternating_step_ratio: one more arm per K, a generate call whose decode steps "
            "alternate between steered and unsteered (the hook registered before a steered step's "
            "clock starts and removed after it stops; which steps are steered flips from call to "
            "call): per call, the median unsteered step over the median steered step, summarised "
            "over rounds; neighbouring steps share the host's state, so this is the least noisy of "
            "the ratios. alternating_noop_ratio: the same with the no-op hook (the cost of "
            "installing a steer); alternating_step_ratio_forward_hook (K = the peer's rank "
            "only): the same steer registered as a forward hook instead (register_forward_hook, "
            "as gss did before it wrapped the block's forward), whose presence alone sends "
            "every call of the block through nn.Module's slow dispatch path. Each round runs the "
            "arms in a fresh seeded order. On CUDA every timed span "
            "(each arm's call, hook loop, decode step) starts and ends with "
            "torch.cuda.synchronize, and hook_seconds_in_generate synchronizes before and after "
            "every hook call, so it times the hook's own kernels (stalling the step, outside the "
            "timed span); on CPU these synchronizes are no-ops."
        ),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "goal": ">= 0.99 of unsteered, and no slower than any peer",
        "peer": nnsight_status(),
        "models": models,
    }


def _noop_hook(module: nn.Module, args: Any, output: Any) -> None:
    return None


def _alternated(ratios: list[float], warmup: int) -> dict[str, float]:
    """The per-call ratios of an alternating arm, warm-up calls left out; a call too short to
    have both kinds of decode step reads nan."""
    return summary([r for r in ratios[warmup:] if math.isfinite(r)] or [math.nan])


def _fmt_ratio(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} ({s['q1']:.3f}-{s['q3']:.3f})"


def _fmt_hook(row: dict[str, Any]) -> str:
    if "hook_seconds_per_call" not in row:  # rows kept from runs before it was measured
        return "--"
    alone = f"{1e6 * row['hook_seconds_per_call']:.0f}"
    if "hook_seconds_in_generate" in row:
        alone = f"{1e6 * row['hook_seconds_in_generate']:.0f} / {alone}"
    return f"{alone} ({100 * row['hook_share_of_step']:.2f}%)"


def _alternating_cell(row: dict[str, Any]) -> str:
    if "alternating_step_ratio" not in row:
        return "--"
    cell = _fmt_ratio(row["alternating_step_ratio"])
    if "alternating_step_ratio_forward_hook" in row:
        cell += f"; as a forward hook {row['alternating_step_ratio_forward_hook']['median']:.3f}"
    return cell


def table(result: dict[str, Any]) -> str:
    header = [
        "model",
        "batch",
        "K",
        "unsteered tok/s",
        "GSS tok/s",
        "GSS / unsteered (IQR)",
        "A/A: unsteered / unsteered",
        "no-op hook / unsteered",
        "GSS / no-op hook",
        "decode step: GSS / unsteered",
        "alternating steps: GSS / unsteered (IQR)",
        "alternating steps: no-op hook / unsteered",
        "hook us/step: in generate / alone (share of a step)",
        "gate open",
        "nnsight / unsteered",
    ]
    rows = []
    for m in result["models"]:
        for r in m["rows"]:
            peer = r.get("peer", {})
            if "ratio" in peer:
                peer_cell = _fmt_ratio(peer["ratio"])
                if "step_ratio" in peer:
                    peer_cell += f"; step {peer['step_ratio']:.3f}"
            elif "error" in peer:
                peer_cell = f"failed: {peer['error']}"[:80]
            elif m["peer"]["status"] != "available":
                peer_cell = m["peer"]["status"][:80]
            else:
                peer_cell = "--"
            rows.append(
                [
                    m["model"],
                    r["batch"],
                    r["rank"],
                    f"{r['tokens_per_s_unsteered']['median']:.1f}",
                    f"{r['tokens_per_s_steered']['median']:.1f}",
                    _fmt_ratio(r["ratio"]),
                    _fmt_ratio(r["aa_ratio"]) if "aa_ratio" in r else "--",
                    _fmt_ratio(r["noop_over_unsteered"]) if "noop_over_unsteered" in r else "--",
                    _fmt_ratio(r["gss_over_noop"]) if "gss_over_noop" in r else "--",
                    f"{r['step_ratio']:.3f}" if "step_ratio" in r else "--",
                    _alternating_cell(r),
                    f"{r['alternating_noop_ratio']['median']:.3f}"
                    if "alternating_noop_ratio" in r
                    else "--",
                    _fmt_hook(r),
                    f"{100 * r['gate_open_share']:.0f}%",
                    peer_cell,
                ]
            )
    return markdown_table(header, rows)
