"""What the vLLM plugin's steer costs in a forward, without vLLM (issue 40, points 2 and 5).

The part the plugin adds to vLLM's fast paths is the op ``gss::vllm_steer`` reading per-token
slots from a persistent buffer written in place before each step. Whole-engine rounds
(``vllm_throughput.py``) wander by 15-50% on these machines, far over issue 40's 2%; a forward
timed with and without the op, arms interleaved, resolves it. A SmolLM2-135M-shaped Llama
(``benchmarks/configs/smollm2-135m``, random weights) runs with block ``--layer``'s output
flattened to (tokens, hidden), as vLLM's layers hand it over, and passed through the op. Per
batch shape (N sequences of one token, a decode step's shape without a KV cache; and one
prefill) it times, eagerly and on the device's fast path (on a GPU a captured CUDA graph
replayed, bfloat16 by default; on a CPU ``torch.compile``, inductor, as vLLM's CPU build
compiles, float32 by default):

* ``plain``: no op (the model as without gss);
* ``op, none steered``: the op with every slot -1 (an engine serving an artifact, the request
  not steered);
* ``op, steered``: every token steered by a hard-gated artifact;
* ``op, ungated``: every token steered by the same artifact with ``gate="none"``.

Each round runs every arm once in a fresh seeded order (``--iters`` forwards each, timed with
CUDA events); ratios are per round against ``plain`` of the same mode, medians reported with
their IQR. It also records how far the fast path is from the same forward run eagerly (a
replayed graph: bit for bit),
whether the unsteered op equals the plain model, and how far the steered op is from
``gss.steer`` on the same model (the transformers hook). Writes ``results.json``,
``table.md`` and ``speed.png`` to ``--out`` (``--report`` redraws the last two)::

    PYTHONPATH=src python3 benchmarks/scripts/vllm_op.py --out results/serve-cuda-op \
        --rounds 8 --iters 20
    .venv/bin/python benchmarks/scripts/vllm_op.py --device cpu --out results/serve-cpu-op \
        --decode 1,16 --prefill 64 --rounds 200 --iters 1
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

import gss
from gss.report import cpu_info
from gss.serving import vllm_op

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m"
ARMS = ("plain", "op, none steered", "op, steered", "op, ungated")
DEVICE = torch.device("cuda")
MODES: tuple[str, ...] = ("eager", "graph")  # ("eager", "compiled") on a CPU
FAST = {"graph": "CUDA graph", "compiled": "torch.compile"}


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def build(
    layer: int, rank: int, work: Path, max_tokens: int, dtype: torch.dtype
) -> tuple[Any, dict[str, Any]]:
    """The model (on DEVICE, in ``dtype``) and two plugin states: the hard-gated artifact and
    its ungated twin, each the only artifact of its state (slot 0)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).eval()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * p.std() * torch.randn_like(p))
    rows = torch.randint(3, config.vocab_size, (32, 64), generator=torch.Generator().manual_seed(0))
    art = gss.calibrate(model, reference, rows, layer=layer, rank=rank, progress=False)
    del reference
    art.save_pretrained(work / "hard", overwrite=True)
    art.with_options(gate="none").save_pretrained(work / "ungated", overwrite=True)
    states = {}
    for name in ("hard", "ungated"):
        state = vllm_op.State()
        state.load({name: str(work / name)})
        state.prepare(DEVICE, dtype, max_tokens)  # as the plugin's install does
        states[name] = state
    return model.to(dtype), {"states": states, "artifact": art}


class OpAtBlock:
    """A forward hook that sends the block's output through the op, flattened to (tokens,
    hidden); ``on`` is read when a forward runs (or is captured)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, module: Any, args: Any, output: Any) -> Any:
        if not self.on:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        flat = hidden.view(-1, hidden.shape[-1])
        steered, hit = torch.ops.gss.vllm_steer(flat, module._gss_layer)
        steered = torch.where(hit, steered, flat).view_as(hidden)  # as the plugin's layer does
        return (steered, *output[1:]) if isinstance(output, tuple) else steered


def set_slots(state: Any, n: int, slot: int) -> None:
    slots = state.buffer(n, DEVICE)
    slots[:n].fill_(slot)
    slots[n:].fill_(-1)


def capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph, out


def replayed(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A captured forward as a function that replays it and returns its (static) output."""

    def run() -> torch.Tensor:
        graph.replay()
        return out

    return run


def time_ms(run: Callable[[], Any], iters: int) -> float:
    if DEVICE.type != "cuda":
        began = time.perf_counter()
        for _ in range(iters):
            run()
        return 1e3 * (time.perf_counter() - began) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def quartiles(values: list[float]) -> dict[str, float]:
    """Median, quartiles and a distribution-free 95% confidence interval of the median: the
    order statistics n/2 -+ 1.96 sqrt(n)/2 (the spread of rounds says how noisy one round is,
    the interval how well the median is pinned by all of them)."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    ordered, n = sorted(values), len(values)
    half = 1.96 * n**0.5 / 2
    # 1-based ranks floor(n/2 - half) and ceil(1 + n/2 + half), as 0-based indices
    lo, hi = max(0, math.floor(n / 2 - half) - 1), min(n - 1, math.ceil(n / 2 + half))
    return {
        "median": statistics.median(values),
        "q1": q[0],
        "q3": q[2],
        "ci95_lo": ordered[lo],
        "ci95_hi": ordered[hi],
    }


def run_shape(
    model: Any,
    hook: OpAtBlock,
    states: dict[str, Any],
    shape: tuple[int, int],
    args: argparse.Namespace,
    art: Any,
) -> dict[str, Any]:
    batch, length = shape
    n = batch * length
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(3, model.config.vocab_size, shape, generator=gen).to(DEVICE)

    def forward() -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    # arm -> (state to read, slot, uses the op)
    arms = {
        "plain": (None, -1, False),
        "op, none steered": ("hard", -1, True),
        "op, steered": ("hard", 0, True),
        "op, ungated": ("ungated", 0, True),
    }

    def prepare(arm: str) -> None:
        state_name, slot, uses_op = arms[arm]
        hook.on = uses_op
        if state_name is not None:
            vllm_op.STATE = states[state_name]
            set_slots(states[state_name], n, slot)

    eager_logits: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for arm in ARMS:
            prepare(arm)
            eager_logits[arm] = forward().clone()
        # the fast path per arm: on a GPU a graph without the op and one per state with it (the
        # slots are read at replay); on a CPU one compiled forward (dynamo guards on hook.on)
        fast: dict[str, Callable[[], torch.Tensor]] = {}
        if MODES[-1] == "graph":
            for arm in ("plain", "op, steered", "op, ungated"):
                prepare(arm)
                graph, out = capture(forward)
                fast[arm] = replayed(graph, out)
            fast["op, none steered"] = fast["op, steered"]
        else:
            compiled = torch.compile(forward, dynamic=False)
            fast = {arm: compiled for arm in ARMS}
        fast_vs_eager = {}
        for arm in ARMS:
            prepare(arm)
            got_logits = fast[arm]()
            sync()
            fast_vs_eager[arm] = float((got_logits.float() - eager_logits[arm].float()).abs().max())
        with gss.steer(model, art):
            hook.on = False
            reference = forward().float()
        prepare("op, steered")
        captured: list[torch.Tensor] = []
        probe = model.model.layers[args.layer].register_forward_hook(
            lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o)
        )
        hook.on = False
        forward()
        probe.remove()
        flat = captured[0].reshape(-1, captured[0].shape[-1])
        steered, _ = torch.ops.gss.vllm_steer(flat, args.layer)
        hidden_changed = float((steered != flat).any(dim=-1).float().mean())

        ratios: dict[str, dict[str, list[float]]] = {m: {a: [] for a in ARMS} for m in MODES}
        ms: dict[str, dict[str, list[float]]] = {m: {a: [] for a in ARMS} for m in MODES}
        order = random.Random(n)
        for _ in range(args.rounds):
            jobs = [(mode, arm) for mode in MODES for arm in ARMS]
            order.shuffle(jobs)
            got: dict[tuple[str, str], float] = {}
            for mode, arm in jobs:
                prepare(arm)
                run = forward if mode == "eager" else fast[arm]
                got[mode, arm] = time_ms(run, args.iters)
            for mode in MODES:
                for arm in ARMS:
                    ms[mode][arm].append(got[mode, arm])
                    ratios[mode][arm].append(got[mode, "plain"] / got[mode, arm])
    return {
        "shape": list(shape),
        "tokens": n,
        "share_of_tokens_the_hard_gate_changed": hidden_changed,
        "fast_path_vs_eager_max_abs_logit_diff": fast_vs_eager,
        "unsteered_op_equals_plain": bool(
            torch.equal(eager_logits["op, none steered"], eager_logits["plain"])
        ),
        "steered_op_vs_gss_steer_max_abs_logit_diff": float(
            (eager_logits["op, steered"].float() - reference).abs().max()
        ),
        "steer_moves_logits_by": float(
            (eager_logits["op, steered"].float() - eager_logits["plain"].float()).abs().max()
        ),
        "ms": {m: {a: quartiles(v) for a, v in arms_.items()} for m, arms_ in ms.items()},
        "speed_vs_plain": {
            m: {a: quartiles(v) for a, v in arms_.items()} for m, arms_ in ratios.items()
        },
    }


def table(results: dict[str, Any]) -> str:
    def fmt(q: dict[str, float]) -> str:
        ci = f"; CI {q['ci95_lo']:.3f}-{q['ci95_hi']:.3f}" if "ci95_lo" in q else ""
        return f"{q['median']:.3f} [{q['q1']:.3f}-{q['q3']:.3f}{ci}]"

    lines = [
        "# The plugin's op in a forward (no vLLM)",
        "",
        f"`{results['command']}`; {results['device']}, torch {results['torch']}, "
        f"transformers {results['transformers']}; SmolLM2-135M shape, random weights, "
        f"{results.get('dtype', 'bfloat16')}, "
        f"op at block {results['layer']}, rank {results['rank']}; {results['rounds']} rounds of "
        f"{results['iters']} forwards per arm, arms in a fresh order each round.",
        "",
        "Speed as plain time / arm time per round (1.0: no cost; median [IQR; 95% confidence "
        "interval of the median, where recorded]); ms: median time of one forward.",
        "",
        "| shape (seqs x tokens) | mode | plain ms | op, none steered | op, steered "
        "| op, ungated | fast path - eager, max logit | unsteered op = plain | hard gate changed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["shapes"]:
        for mode in r["ms"]:
            s = r["speed_vs_plain"][mode]
            if "replay_equals_eager" in r:  # an earlier run's results.json
                same = r["replay_equals_eager"]
                eq = "0 (bit-equal)" if all(same.values()) else str(same)
            else:
                gap = max(r["fast_path_vs_eager_max_abs_logit_diff"].values())
                eq = "0 (bit-equal)" if gap == 0 else f"{gap:.2g}"
            kind = FAST.get(mode, mode)
            lines.append(
                f"| {r['shape'][0]} x {r['shape'][1]} | {kind} | "
                f"{r['ms'][mode]['plain']['median']:.3f} | {fmt(s['op, none steered'])} | "
                f"{fmt(s['op, steered'])} | {fmt(s['op, ungated'])} | "
                f"{eq if mode != 'eager' else ''} | "
                f"{'yes' if r['unsteered_op_equals_plain'] else 'NO'} | "
                f"{100 * r['share_of_tokens_the_hard_gate_changed']:.0f}% |"
            )
    lines += [
        "",
        "Steered op vs `gss.steer` (the transformers hook) on the same model, largest logit "
        "difference / largest logit move of the steer: "
        + "; ".join(
            f"{r['shape'][0]}x{r['shape'][1]}: "
            f"{r['steered_op_vs_gss_steer_max_abs_logit_diff']:.3g} / "
            f"{r['steer_moves_logits_by']:.3g}"
            for r in results["shapes"]
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def figure(results: dict[str, Any], path: Path) -> None:
    """Speed vs plain per shape: the steered op eager and replayed in a CUDA graph."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = results["shapes"]
    labels = [f"{r['shape'][0]}x{r['shape'][1]}" for r in shapes]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / (2 * (len(ARMS) - 1))
    for j, mode in enumerate(m for m in ("eager", *FAST) if m in shapes[0]["ms"]):
        for k, arm in enumerate(ARMS[1:]):
            i = j * (len(ARMS) - 1) + k
            q = [r["speed_vs_plain"][mode][arm] for r in shapes]
            med = [x["median"] for x in q]
            lo, hi = ("ci95_lo", "ci95_hi") if "ci95_lo" in q[0] else ("q1", "q3")
            err = [[x["median"] - x[lo] for x in q], [x[hi] - x["median"] for x in q]]
            xs = [n + (i - 2.5) * width for n in range(len(shapes))]
            name = FAST.get(mode, mode)
            ax.bar(xs, med, width, yerr=err, label=f"{name}: {arm}", alpha=0.6 + 0.4 * j)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.98, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(shapes)), labels)
    ax.set_xlabel("batch shape (sequences x tokens)")
    ax.set_ylabel("plain time / arm time")
    ax.set_ylim(0.8, 1.15)
    bars = "95% CI" if "ci95_lo" in shapes[0]["speed_vs_plain"]["eager"]["plain"] else "IQR"
    ax.set_title(f"gss::vllm_steer in a {results['device']} forward (median, {bars})", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table(results))
    figure(results, out / "speed.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layer", type=int, default=20)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--decode", default="1,16,64,256", help="decode batch sizes")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gss-op"))
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda if any"
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument(
        "--report", action="store_true", help="only redraw table.md and speed.png from results.json"
    )
    args = parser.parse_args()
    if args.report:
        write(json.loads((args.out / "results.json").read_text()), args.out)
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here (use --device cpu)")
    global DEVICE, MODES
    DEVICE = torch.device(device)
    MODES = ("eager", "graph") if device == "cuda" else ("eager", "compiled")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shapes = [(int(b), 1) for b in args.decode.split(",")] + [(1, args.prefill)]
    model, built = build(args.layer, args.rank, args.work, max(b * t for b, t in shapes), dtype)
    block = model.model.layers[args.layer]
    block._gss_layer = args.layer
    hook = OpAtBlock()
    block.register_forward_hook(hook)
    results: dict[str, Any] = {
        "command": "python3 benchmarks/scripts/vllm_op.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name()
        if DEVICE.type == "cuda"
        else "{cpu} ({cpu_capability}), {n} CPUs".format(n=os.cpu_count(), **cpu_info()),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "layer": args.layer,
        "rank": args.rank,
        "rounds": args.rounds,
        "iters": args.iters,
        "shapes": [],
    }
    for shape in shapes:
        r = run_shape(model, hook, built["states"], shape, args, built["artifact"])
        results["shapes"].append(r)
        print(
            json.dumps(
                {
                    k: r[k]
                    for k in (
                        "shape",
                        "fast_path_vs_eager_max_abs_logit_diff",
                        "unsteered_op_equals_plain",
                    )
                }
            ),
            flush=True,
        )
    results["seconds"] = time.perf_counter() - started
    write(results, args.out)
    print(table(results))


if __name__ == "__main__":
    main()
