"""vLLM with the gss plugin generates what transformers generates with ``gss.steer``.

A tiny random Llama (head_dim 64: vLLM's CPU attention takes no smaller) and an artifact
calibrated on it at block 1; one vLLM engine serves a batch that mixes steered and unsteered
requests under chunked prefill (a small token budget splits the prompts across steps, so
prefill chunks and decode tokens of different requests share a forward). Greedy outputs must
equal transformers' token for token, steered with ``gss.steer`` or not, and the unsteered
requests must be bit-identical (log-probabilities included) to an engine without the plugin
(on CUDA: within vLLM's own spread, ``CUDA_SPREAD``).
With a server-wide default artifact, requests naming none are steered by it and those naming
``"none"`` are not. The same holds, compiled, on the other architectures gss steers (Qwen2,
Mistral, Qwen3; GPT-2 and OPT, whose vLLM decoder layers return one tensor, not Llama's
(hidden, residual) pair; GPT-NeoX, which vLLM runs through its Transformers backend); with
speculative decoding (ngram, a draft model, an EAGLE head), tensor and pipeline
parallelism, and a LoRA adapter served by vLLM.

Each engine runs in a process of its own (``engine_run.py``), one after the other. The last
test starts the OpenAI server through ``gss serve`` (the plugin loaded by its entry point) and
asks it over HTTP.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import gss

from .engine_run import INTERPRET_ENV

HERE = Path(__file__).resolve().parent
VOCAB, HIDDEN, HEADS, LAYERS = 512, 256, 4, 2
MAX_TOKENS = 12
STEER_NAME = "tiny"
# (prompt length, steered?): lengths over the 32-token budget are prefilled in chunks
PROMPTS = [(7, True), (40, False), (19, True), (33, True), (5, False), (26, False), (45, True)]
# vLLM's CUDA build is not bit-reproducible from one engine to the next, compiled or eager: on
# an H200 two engines without the plugin gave 28 of 84 log-probs up to 5.4e-5 apart compiled,
# 57 of 84 up to 7.3e-5 eager (benchmarks/vllm_gpu/repeat.py, results/serve-cuda/repeat-*.json),
# while the plugin's engine with none steered equalled the first bit for bit in both. There
# unsteered log-probs are held to that spread (tokens stay exact); on the CPU build, which is
# reproducible, to bit-equality.
CUDA_SPREAD = 1e-4

pytestmark = pytest.mark.heavy


def tiny_model(seed: int, arch: str = "llama") -> Any:
    """A tiny random model of one of the architectures gss steers in transformers: Llama,
    Mistral, Qwen2 and Qwen3 (vLLM's decoder layers return (hidden, residual); Qwen2 with biased
    attention projections, Qwen3 with q/k norms) or GPT-2, GPT-NeoX and OPT (layers return one
    tensor; learned or partial rotary positions; OPT projects its embeddings)."""
    import transformers

    torch.manual_seed(seed)
    tokens: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    # initializer_range larger than the default: fewer near-ties in the argmax
    shape = {"vocab_size": VOCAB, "initializer_range": 0.05, **tokens}
    if arch == "gpt2":
        config: Any = transformers.GPT2Config(
            n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=256, **shape
        )
        return transformers.GPT2LMHeadModel(config).float().eval()
    shape.update(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if arch == "gpt_neox":
        config = transformers.GPTNeoXConfig(intermediate_size=2 * HIDDEN, **shape)
        return transformers.GPTNeoXForCausalLM(config).float().eval()
    if arch == "opt":
        config = transformers.OPTConfig(
            word_embed_proj_dim=HIDDEN // 2, ffn_dim=2 * HIDDEN, **shape
        )
        return transformers.OPTForCausalLM(config).float().eval()
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra: dict[str, Any] = {"mistral": {"sliding_window": None}, "qwen3": {"head_dim": 64}}
    config = config_class(
        intermediate_size=2 * HIDDEN,
        num_key_value_heads=HEADS if arch == "llama" else HEADS // 2,
        **extra.get(arch, {}),
        **shape,
    )
    return model_class(config).float().eval()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :].tolist()


def save_tiny(
    root: Path, artifacts: dict[str, int], arch: str = "llama"
) -> tuple[Any, list[list[int]]]:
    """A tiny model saved in ``root/model``, an artifact (rank 2, delta 25) calibrated on it at
    each ``{folder: block}`` of ``artifacts`` saved in ``root/folder``, and PROMPTS' prompts."""
    model, reference = tiny_model(0, arch), tiny_model(1, arch)
    model.save_pretrained(root / "model")
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(3, VOCAB, (48, 32), generator=gen)
    for folder, layer in artifacts.items():
        art = gss.calibrate(model, reference, rows, layer=layer, rank=2, progress=False)
        art.with_options(delta=25.0).save_pretrained(root / folder)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n, _ in PROMPTS]
    return model, prompts


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gss-vllm")
    # at block 0 the steer changes the KV of block 1: what prefix caching must not share
    model, prompts = save_tiny(root, {"artifact": 1, "artifact0": 0})
    plain = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    with gss.steer(model, gss.load(root / "artifact")):
        steered = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    with gss.steer(model, gss.load(root / "artifact0")):
        steered0 = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    return {
        "root": root,
        "prompts": prompts,
        "plain": plain,
        "steered": steered,
        "steered0": steered0,
    }


class EngineFailed(AssertionError):
    """A vLLM run that exited non-zero: the message shows the log's tail (vLLM's startup
    log is long), ``log`` keeps all of it for tests that look for the cause."""

    def __init__(self, tag: str, log: str) -> None:
        super().__init__(f"vLLM run {tag} failed:\n{log[-12000:]}")
        self.log = log


def run_engine(
    root: Path,
    prompts: list[list[int]],
    names: list[str | None],
    *,
    plugin: bool,
    tag: str,
    enforce_eager: bool = True,
    artifact: str = "artifact",
    runner_v2: bool = False,
    environ: dict[str, str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """One engine's greedy run (``engine_run.py``); ``runner_v2``: with vLLM's Model Runner V2
    (without CUDA, its Triton kernels in Triton's interpreter), else its V1 runner;
    ``environ``: variables set for the engine's processes."""
    job = {
        **options,
        "model": str(root / "model"),
        "prompts": prompts,
        "artifacts": names,
        "max_tokens": MAX_TOKENS,
        "max_num_batched_tokens": 32,
        "enforce_eager": enforce_eager,
    }
    job_file, out_file = root / f"{tag}.json", root / f"{tag}.out.json"
    job_file.write_text(json.dumps(job))
    env = dict(os.environ)
    env.pop("GSS_VLLM_ARTIFACTS", None)
    if plugin:
        from gss.serving import vllm_plugin

        env[vllm_plugin.ENV] = json.dumps({STEER_NAME: str(root / artifact)})
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner_v2 else "0"
    if runner_v2 and not torch.cuda.is_available():
        env[INTERPRET_ENV] = "1"
    env.update(environ or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(job_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        raise EngineFailed(tag, proc.stdout + proc.stderr)
    return {**json.loads(out_file.read_text()), "log": proc.stdout + proc.stderr}


def logprob_differences(
    a: dict[str, Any], b: dict[str, Any], requests: list[int]
) -> list[tuple[int, int, float]]:
    """(request, token, difference) wherever two engine runs' log-probs of ``requests``
    differ."""
    return [
        (i, t, x - y)
        for i in requests
        for t, (x, y) in enumerate(zip(a["logprobs"][i], b["logprobs"][i], strict=True))
        if x != y
    ]


def run_mixed(
    setup: dict[str, Any], tag: str, steered: str = "steered", **options: Any
) -> tuple[dict[str, Any], list[list[int]]]:
    """The mixed batch (PROMPTS) through an engine with the plugin, and what transformers
    gives for it: ``gss.steer``'s greedy tokens (``setup[steered]``) for the steered prompts,
    the plain ones for the others."""
    names = [STEER_NAME if on else None for _, on in PROMPTS]
    got = run_engine(setup["root"], setup["prompts"], names, plugin=True, tag=tag, **options)
    expected = [
        s if on else p
        for s, p, (_, on) in zip(setup[steered], setup["plain"], PROMPTS, strict=True)
    ]
    return got, expected


def test_steer_changes_greedy_output(setup: dict[str, Any]) -> None:
    changed = [
        s != p
        for s, p, (_, on) in zip(setup["steered"], setup["plain"], PROMPTS, strict=True)
        if on
    ]
    assert any(changed), "the artifact changes no steered prompt's greedy output: no test"


def check_mixed_batch(setup: dict[str, Any], tag: str, **options: Any) -> None:
    """The mixed batch equals transformers token for token (steered: ``gss.steer``), and its
    unsteered requests equal an engine without the plugin bit for bit, log-probs included
    (CUDA: within vLLM's own spread)."""
    root, prompts = setup["root"], setup["prompts"]
    with_plugin, expected = run_mixed(setup, f"gss-{tag}", **options)
    assert with_plugin["tokens"] == expected

    without = run_engine(
        root, prompts, [None] * len(prompts), plugin=False, tag=f"plain-{tag}", **options
    )
    assert without["tokens"] == setup["plain"]
    unsteered = [i for i, (_, on) in enumerate(PROMPTS) if not on]
    for i in unsteered:
        assert with_plugin["tokens"][i] == without["tokens"][i]
    # bit for bit, log-probabilities included (CUDA: within vLLM's own spread); the
    # message says by how much they differ
    spread = CUDA_SPREAD if torch.cuda.is_available() else 0.0
    differ = [d for d in logprob_differences(with_plugin, without, unsteered) if abs(d[2]) > spread]
    assert not differ, (
        f"{len(differ)} of {sum(len(without['logprobs'][i]) for i in unsteered)} log-probs of "
        f"unsteered requests differ from the engine without the plugin by more than {spread}, "
        f"at most by {max(abs(d) for *_, d in differ):.3g} (request, token, difference): "
        f"{differ[:8]}"
    )


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_vllm_plugin_matches_transformers(setup: dict[str, Any], enforce_eager: bool) -> None:
    check_mixed_batch(setup, "eager" if enforce_eager else "compiled", enforce_eager=enforce_eager)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_model_runner_v2_matches_transformers(setup: dict[str, Any], enforce_eager: bool) -> None:
    """The same with vLLM's Model Runner V2 (its default on CUDA where Triton is installed),
    whose requests, batch layout and forward the plugin follows through other methods than
    V1's. Without CUDA its Triton kernels run in Triton's interpreter (``engine_run.py``)."""
    tag = "v2-eager" if enforce_eager else "v2-compiled"
    check_mixed_batch(setup, tag, enforce_eager=enforce_eager, runner_v2=True)


def test_compiled_engine_with_the_triton_kernel_matches_transformers(setup: dict[str, Any]) -> None:
    """The mixed batch, compiled, with the op steering through its Triton kernel (what it does
    on CUDA; here in Triton's interpreter, on the CPU): the steered requests get ``gss.steer``'s
    tokens, the others the plain model's (the kernel never touches them: the layer keeps their
    outputs)."""
    pytest.importorskip("triton")
    from gss.serving import vllm_plugin

    environ = {vllm_plugin.TRITON_ENV: "1"}
    if not torch.cuda.is_available():
        environ["TRITON_INTERPRET"] = "1"
    got, expected = run_mixed(setup, "gss-triton", enforce_eager=False, environ=environ)
    assert "the steer runs as the Triton kernel at layer(s)" in got["log"]
    assert got["tokens"] == expected


def greedy_gaps(model: Any, prompt: list[int], tokens: list[int]) -> tuple[list[float], float]:
    """Teacher-forced over ``tokens``: how far below transformers' top logit each one's logit
    is (0: its greedy choice), and the largest logit seen."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(-1, torch.tensor(tokens).view(-1, 1))[:, 0]
    return (logits.max(-1).values - chosen).tolist(), float(logits.abs().max())


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_bfloat16_unsteered_requests_stay_bit_identical(
    setup: dict[str, Any], enforce_eager: bool
) -> None:
    """bfloat16, which vLLM's ``dtype="auto"`` picks for most checkpoints: the unsteered
    requests of the mixed batch equal an engine without the plugin bit for bit, log-probs
    included (the plugin used to hand the steered layer's hidden + residual on as one
    bfloat16 sum, which the next layer adds in float32: unsteered log-probs moved by up to
    0.015). Every token, steered or not, is transformers' bfloat16 greedy choice (under
    ``gss.steer`` for the steered requests) up to a near-tie: within two bfloat16 steps of the
    top logit, where vLLM's and transformers' bfloat16 arithmetic may choose differently (the
    plain engine does here once); a steer left out would miss by about 2."""
    from transformers import AutoModelForCausalLM

    root, prompts = setup["root"], setup["prompts"]
    tag = "eager" if enforce_eager else "compiled"
    options: dict[str, Any] = {"enforce_eager": enforce_eager, "dtype": "bfloat16"}
    with_plugin, _ = run_mixed(setup, f"bf16-gss-{tag}", **options)  # not float32's tokens
    without = run_engine(
        root, prompts, [None] * len(prompts), plugin=False, tag=f"bf16-plain-{tag}", **options
    )
    unsteered = [i for i, (_, on) in enumerate(PROMPTS) if not on]
    differ = logprob_differences(with_plugin, without, unsteered)
    assert not differ, f"{len(differ)} unsteered log-probs differ: {differ[:8]}"
    for i in unsteered:
        assert with_plugin["tokens"][i] == without["tokens"][i]

    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.bfloat16).eval()
    artifact = gss.load(root / "artifact")
    for i, (prompt, (_, on)) in enumerate(zip(prompts, PROMPTS, strict=True)):
        with gss.steer(model, artifact) if on else contextlib.nullcontext():
            gaps, largest = greedy_gaps(model, prompt, with_plugin["tokens"][i])
        tie = 2 * 2.0 ** (math.floor(math.log2(largest)) - 7)  # two bfloat16 steps
        assert max(gaps) <= tie, f"request {i} (steered: {on}): gaps {gaps}, a tie is {tie}"


def test_server_default_steers_requests_that_name_none(setup: dict[str, Any]) -> None:
    """With a server-wide default (``additional_config={"gss_default": NAME}``, what ``gss
    serve --default`` passes), a request naming no artifact is steered by it and, where the
    operator allowed opting out (``--allow-opt-out``), one naming ``"none"`` is served
    unsteered, in the same mixed batch."""
    from gss.serving import vllm_plugin

    names: list[str | None] = [None if on else vllm_plugin.NO_STEER for _, on in PROMPTS]
    default = {
        "additional_config": {vllm_plugin.DEFAULT_KEY: STEER_NAME, vllm_plugin.OPT_OUT_KEY: True}
    }
    got = run_engine(
        setup["root"], setup["prompts"], names, plugin=True, tag="default", engine_args=default
    )
    expected = [
        s if on else p
        for s, p, (_, on) in zip(setup["steered"], setup["plain"], PROMPTS, strict=True)
    ]
    assert got["tokens"] == expected


ENGINES: dict[str, dict[str, Any]] = {
    # ngram drafts from each request's own tokens (prompt_lookup_min 1: a token seen before is
    # enough, which in these prompts is nearly every step of every request), verified several
    # tokens per request per step: the slots cover the speculative tokens
    "speculative": {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        }
    },
    # a draft model, here the target itself unsteered (speculative_config's "model", filled in
    # by the test): its drafts follow the unsteered model, so a steered request's are rejected
    # where the steer changes the greedy token, and the target, steered, verifies every one
    "draft-model": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}},
    # an EAGLE head (``eagle_head``, random: the target rejects all its drafts), which drafts
    # from the target's last hidden states, steered ones for a steered request
    "eagle": {"speculative_config": {"method": "eagle", "num_speculative_tokens": 3}},
    # two workers, each with half of every layer's heads; the block output each steers is whole
    "tensor-parallel": {"tensor_parallel_size": 2},
    # block 0 on one worker, block 1 (the artifact's) on the other, which alone steers it
    "pipeline-parallel": {"pipeline_parallel_size": 2},
}


def skip_unless_workers(count: int) -> None:
    """On the CPU build any number of workers runs; on CUDA each takes a GPU of its own."""
    if torch.cuda.is_available() and torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs, this machine has {torch.cuda.device_count()}")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_speculative_and_parallel_engines_match_transformers(
    setup: dict[str, Any], engine: str
) -> None:
    """The mixed batch through vLLM's speculative decoding (ngram, a draft model, an EAGLE
    head) and its tensor and pipeline parallelism (2 CPU workers), compiled: every output
    equals transformers' greedy output."""
    args = engine_args(setup, engine)
    skip_unless_workers(args.get("tensor_parallel_size", 1) * args.get("pipeline_parallel_size", 1))
    got, expected = run_mixed(setup, engine, enforce_eager=False, engine_args=args, metrics=True)
    assert got["tokens"] == expected
    assert got["parallel"] == {
        "tensor": args.get("tensor_parallel_size", 1),
        "pipeline": args.get("pipeline_parallel_size", 1),
    }
    if "speculative_config" in args:
        check_drafts(got, some_accepted=engine != "eagle")


def test_model_runner_v2_with_a_draft_model_matches_transformers(setup: dict[str, Any]) -> None:
    """Speculative decoding with a draft model through Model Runner V2, compiled (V2's ngram
    proposer does not run in Triton's interpreter: docs/serving.md, Limits): the same mixed
    batch, every output transformers' greedy output."""
    args = engine_args(setup, "draft-model")
    got, expected = run_mixed(
        setup, "v2-draft-model", enforce_eager=False, runner_v2=True, engine_args=args, metrics=True
    )
    assert "Using V2 Model Runner" in got["log"]
    assert got["tokens"] == expected
    check_drafts(got)


def engine_args(setup: dict[str, Any], engine: str) -> dict[str, Any]:
    """ENGINES' arguments for ``engine``, the path of its draft model or EAGLE head filled in."""
    args = copy.deepcopy(ENGINES[engine])
    method = args.get("speculative_config", {}).get("method")
    if method == "draft_model":
        args["speculative_config"]["model"] = str(setup["root"] / "model")
    elif method == "eagle":
        args["speculative_config"]["model"] = str(eagle_head(setup["root"]))
    return args


def eagle_head(root: Path) -> Path:
    """An EAGLE draft head for the tiny Llama in ``root/model``, written to ``root/eagle``: one
    decoder layer (a copy of the model's first, without its input norm, as vLLM's
    ``EagleLlamaForCausalLM`` has it) after ``fc``, which maps the next token's embedding and
    the target's hidden state to the layer's input; embeddings and head are the target's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    directory = root / "eagle"
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    model.config.num_hidden_layers = 1
    model.config.save_pretrained(directory)
    prefix = "model.layers.0."
    weights = {
        name.removeprefix("model."): tensor.clone()
        for name, tensor in model.state_dict().items()
        if name.startswith(prefix) and "input_layernorm" not in name
    }
    gen = torch.Generator().manual_seed(3)
    weights["fc.weight"] = 0.05 * torch.randn(HIDDEN, 2 * HIDDEN, generator=gen)
    save_file(weights, str(directory / "model.safetensors"))
    return directory


def check_drafts(got: dict[str, Any], some_accepted: bool = True) -> None:
    """Drafts were proposed and some rejected; ``some_accepted``: some accepted too."""
    metrics = got["metrics"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert accepted < drafted and (accepted > 0 or not some_accepted), metrics


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "mistral", "qwen3", "gpt_neox", "opt"])
def test_other_architectures_match_transformers(arch: str, tmp_path: Path) -> None:
    """Beyond Llama, the other architectures gss steers in transformers: Qwen2, Mistral and
    Qwen3 (their layers return (hidden, residual) as Llama's do), GPT-2, GPT-NeoX and OPT (their
    layers return the block output as one tensor), on the compiled path, a mixed batch under
    chunked prefill."""
    model, prompts = save_tiny(tmp_path, {"artifact": 0}, arch)
    plain = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    with gss.steer(model, gss.load(tmp_path / "artifact")):
        steered = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    expected = [s if on else p for s, p, (_, on) in zip(steered, plain, PROMPTS, strict=True)]
    assert expected != plain, "the artifact changes no steered prompt's greedy output: no test"
    names = [STEER_NAME if on else None for _, on in PROMPTS]
    got = run_engine(tmp_path, prompts, names, plugin=True, tag=arch, enforce_eager=False)
    assert got["tokens"] == expected


def lora_adapter(model: Any, directory: Path, rank: int = 8, alpha: int = 16) -> Any:
    """Write a random LoRA adapter of ``model`` (q_proj and v_proj of every layer, PEFT's file
    layout) into ``directory`` and return the model with the adapter merged into its weights:
    what a user who fine-tuned with LoRA calibrates on and vLLM serves as base + adapter."""
    from safetensors.torch import save_file

    targets = ["q_proj", "v_proj"]
    merged = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for i, layer in enumerate(merged.model.layers):
        for name in targets:
            linear = getattr(layer.self_attn, name)
            a = 0.05 * torch.randn(rank, linear.in_features, generator=gen)
            b = 0.05 * torch.randn(linear.out_features, rank, generator=gen)
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            with torch.no_grad():
                linear.weight += (alpha / rank) * b @ a
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return merged


def test_lora_adapter_served_by_vllm_matches_the_merged_model(tmp_path: Path) -> None:
    """A LoRA fine-tune served as base model + adapter (vLLM's ``enable_lora``, one
    ``LoRARequest`` per request), the artifact calibrated on the merged model: requests with
    the adapter and the steer equal ``gss.steer`` on the merged model; with the adapter alone,
    the merged model; with neither, the base model. One engine, the four kinds mixed."""
    base, reference = tiny_model(0), tiny_model(1)
    base.save_pretrained(tmp_path / "model")
    merged = lora_adapter(base, tmp_path / "adapter")
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(3, VOCAB, (48, 32), generator=gen)
    art = gss.calibrate(merged, reference, rows, layer=1, rank=2, progress=False)
    art.with_options(delta=25.0).save_pretrained(tmp_path / "artifact")
    # (prompt length, adapter?, steered?)
    kinds = [(7, True, True), (40, True, False), (19, False, False), (33, True, True)]
    kinds += [(5, False, False), (26, True, False), (45, True, True)]
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n, _, _ in kinds]
    expected = []
    for prompt, (_, lora, steered) in zip(prompts, kinds, strict=True):
        if steered:
            with gss.steer(merged, gss.load(tmp_path / "artifact")):
                expected.append(hf_greedy(merged, prompt, MAX_TOKENS))
        else:
            expected.append(hf_greedy(merged if lora else base, prompt, MAX_TOKENS))
    merged_plain = [hf_greedy(merged, p, MAX_TOKENS) for p in prompts]
    base_plain = [hf_greedy(base, p, MAX_TOKENS) for p in prompts]
    assert merged_plain != base_plain, "the adapter changes no greedy output: no test"
    assert any(
        e != m for e, m, (_, _, on) in zip(expected, merged_plain, kinds, strict=True) if on
    ), "the artifact changes no steered output: no test"
    got = run_engine(
        tmp_path,
        prompts,
        [STEER_NAME if on else None for _, _, on in kinds],
        plugin=True,
        tag="lora",
        enforce_eager=False,
        # max_loras 2, not 1: vLLM's CPU LoRA ops pick the adapter of a token by indexing
        # the stacked adapters with its slot, and a request without one has slot -1, which
        # torch reads as the last slot; with one slot that is the adapter, so base requests
        # get it (seen with and without gss; vllm/lora/ops/torch_ops/lora_ops.py)
        engine_args={"enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
        loras=[str(tmp_path / "adapter") if lora else None for _, lora, _ in kinds],
    )
    assert got["tokens"] == expected


def test_artifact_is_refused_on_another_fine_tune(setup: dict[str, Any], tmp_path: Path) -> None:
    """The artifact of the tiny model, served by vLLM on a copy of it whose block 0 MLP down
    projection changed (another fine-tune of the same base; its embeddings as they were), is
    refused at engine start, naming the block: the plugin reads vLLM's block weights as it
    loads them, before vLLM's CPU build repacks its linear weights out of reach. The artifact
    on its own model starts (the tests above)."""
    other = tiny_model(0)  # the model the artifact was calibrated on (save_tiny)
    down = other.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        down.add_(torch.randn(down.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    other.save_pretrained(tmp_path / "model")
    artifact = str(setup["root"] / "artifact")
    with pytest.raises(EngineFailed) as failed:
        run_engine(
            tmp_path,
            setup["prompts"][:1],
            [STEER_NAME],
            plugin=True,
            tag="other-fine-tune",
            artifact=artifact,
        )
    log = failed.value.log  # the whole log: the message shows only its tail
    assert "calibrated for another model than the one vLLM serves" in log
    assert "decoder block(s) [0]" in log and "mlp.down_proj.weight" in log
    assert "embeddings differ" not in log


def test_prefix_cache_is_not_shared_across_steers(setup: dict[str, Any]) -> None:
    """The prompts first run unsteered (their prefix blocks cached), then mixed: a steered
    request must not reuse the unsteered KV (the plugin salts its prefix-cache key)."""
    got, expected = run_mixed(
        setup,
        "prefix-cache",
        steered="steered0",
        artifact="artifact0",
        prefix_caching=True,
        block_size=32,
        warm_up_unsteered=True,
    )
    assert got["tokens"] == expected
    # the unsteered prompts of over a block did reuse their cached prefix
    assert all(
        c >= 32
        for c, (n, on) in zip(got["cached_tokens"], PROMPTS, strict=True)
        if n >= 33 and not on
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_until_up(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"gss serve exited ({proc.returncode}):\n{log.read_text()[-8000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"the server did not come up in {timeout} s:\n{log.read_text()[-8000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The server and the engine processes it started (their own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _complete(base: str, body: dict[str, Any]) -> list[int]:
    """One greedy /v1/completions request; the generated token ids (`Refused`: an HTTP error).
    With the ``openai`` client where it is installed (vLLM depends on it), else urllib."""
    extra = {key: body[key] for key in ("vllm_xargs",) if key in body}
    extra.update(ignore_eos=True, return_token_ids=True)
    try:
        import openai
    except ImportError:
        request = urllib.request.Request(
            f"{base}/v1/completions",
            json.dumps({**body, **extra, "temperature": 0.0}).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return list(json.load(response)["choices"][0]["token_ids"])
        except urllib.error.HTTPError as err:
            raise Refused(err.code, err.read().decode(errors="replace")) from None
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        out = client.completions.create(
            model=body["model"],
            prompt=body["prompt"],
            max_tokens=body["max_tokens"],
            temperature=0.0,
            extra_body=extra,
        )
    except openai.APIStatusError as err:
        raise Refused(err.status_code, str(err)) from None
    return list(out.choices[0].model_extra["token_ids"])


@pytest.mark.parametrize(
    "processes", [[], ["--data-parallel-size", "2"]], ids=["one-engine", "data-parallel-2"]
)
def test_gss_serve_openai_server(
    setup: dict[str, Any], tmp_path: Path, processes: list[str]
) -> None:
    """``gss serve`` starts vLLM's OpenAI server (``vllm serve``) with the artifact; a request
    with ``vllm_xargs: {"gss": name}`` is steered as ``gss.steer`` steers transformers, one
    without is not, all in flight together; a request naming an unknown artifact is refused
    (HTTP 400) and the server goes on. Also with two data-parallel engines, behind two API
    server processes (vLLM's default for data parallelism 2): each engine and each API server
    loads the plugin by its entry point. That server has the artifact as its default
    (``--default``, opting out allowed): the steered requests name none, the others ask for
    ``"none"``."""
    skip_unless_workers(2 if processes else 1)
    root, prompts = setup["root"], setup["prompts"]
    on = next(
        i
        for i, (_, steered) in enumerate(PROMPTS)
        if steered and setup["steered"][i] != setup["plain"][i]
    )
    port = _free_port()
    model = str(root / "model")
    command = [sys.executable, "-m", "gss", "serve", "--model", model]
    command += ["--artifact", f"{STEER_NAME}={root / 'artifact'}"]
    by_default = bool(processes)
    command += ["--default", STEER_NAME, "--allow-opt-out"] if by_default else []
    command += ["--host", "127.0.0.1", "--port", str(port), "--"]
    command += ["--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager", "--seed", "0"]
    command += ["--max-model-len", "128", "--max-num-batched-tokens", "32", *processes]
    env = dict(os.environ)
    for name in ("GSS_VLLM_ARTIFACTS", "VLLM_PLUGINS", "VLLM_USE_V2_MODEL_RUNNER"):
        env.pop(name, None)  # the runner: gss serve's choice
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_until_up(proc, f"{base}/health", log, timeout=600)
        common = {"model": model, "max_tokens": MAX_TOKENS}
        unknown = {**common, "prompt": prompts[on], "vllm_xargs": {"gss": "no-such-artifact"}}
        with pytest.raises(Refused, match="no-such-artifact") as refused:
            _complete(base, unknown)
        assert refused.value.status == 400
        asks = {True: {"gss": STEER_NAME}, False: None}  # steered, not
        if by_default:
            asks = {True: None, False: {"gss": "none"}}
        bodies = [
            {**common, "prompt": prompt, **({"vllm_xargs": asks[yes]} if asks[yes] else {})}
            for prompt, (_, yes) in zip(prompts, PROMPTS, strict=True)
        ]
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda body: _complete(base, body), bodies))
        expected = [
            s if yes else p
            for s, p, (_, yes) in zip(setup["steered"], setup["plain"], PROMPTS, strict=True)
        ]
        assert got == expected
        assert proc.poll() is None, log.read_text()[-4000:]
    finally:
        _stop(proc)
    text = log.read_text()
    # loaded by the entry point alone, in each engine
    engines = 2 if processes else 1
    assert text.count("gss steers decoder layer(s) [1]") == engines
    if processes:
        assert "Started 2 API server processes" in text
