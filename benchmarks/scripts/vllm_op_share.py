"""The share of vLLM's own forward that gss's op takes, timed inside the engine.

`vllm_throughput.py` compares whole engines, whose rounds wander by 15-40% on this CPU;
`vllm_op.py` times the op against a transformers forward, not vLLM's. This script measures
the op where it runs when serving: one engine (in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) serving the artifact that ``vllm_throughput.py prep``
made, every request steered, with the runner's ``_model_forward`` and the op's whole body
(``steered_block_output``, registered as ``gss::vllm_steer``'s CPU kernel, which vLLM's
compiled graph calls as the eager model does) each wrapped in a timer. The share is op time /
forward time, step by step, so the machine's drift falls on both alike. On a CPU both are
synchronous, so the timers read the work itself. On a GPU the op runs inside CUDA graphs,
where no timer reaches it: there each step's forward is timed on the device (CUDA events
around ``_model_forward``) beside the host's time for the call, and an engine without the
artifact (``--artifact plain``), run the same way, gives the forward to compare, step by step
medians by phase (thousands of steps, where whole-engine throughput rounds on an H200 swung
by 20%: docs/serving.md, "vLLM on an H200").

Not in the op's time: the dispatcher's call into it, timed apart (``dispatch_us``: the op
through ``torch.ops`` minus its body called directly, on one token that nothing steers), and
its effect on the compiled graph around it (the layer's add of hidden and residual for the
op, the selection of each token's outputs after it; inductor cannot fuse across an opaque op).

    .venv/bin/python benchmarks/scripts/vllm_throughput.py prep
    .venv-vllm/bin/python benchmarks/scripts/vllm_op_share.py --mode compiled \
        --out results/serve-op-share
    .venv-vllm/bin/python benchmarks/scripts/vllm_op_share.py --mode eager \
        --out results/serve-op-share

Writes ``<mode>-<artifact>.json`` (every step's tokens, forward and op seconds) and, from
every JSON there, ``table.md`` (``--report`` rebuilds them from the steps, in any env).
``--artifact none``: the same steer ungated (every token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vllm_throughput import THREAD_ENV, WORK, make_engine, params

ROOT = Path(__file__).resolve().parents[2]


class Timers:
    """Per forward: its tokens, sequences, wall seconds, and the seconds inside the op; on a
    GPU (``cuda``), the forward's device seconds from CUDA events, the host's wall seconds for
    the call beside them, and no op time (`resolve` reads the events after a synchronize)."""

    def __init__(self, cuda: bool = False) -> None:
        self.steps: list[dict[str, Any]] = []
        self.op_s = 0.0
        self.recording = False
        self.cuda = cuda
        self.events: list[tuple[Any, Any]] = []

    def resolve(self) -> None:
        """Each step's device seconds from its events (on a GPU; after the work is done)."""
        if not self.cuda:
            return
        import torch

        torch.cuda.synchronize()
        for step, (start, end) in zip(self.steps, self.events, strict=True):
            step["forward_s"] = start.elapsed_time(end) / 1e3
        self.events = []

    def wrap_op(self, body: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return body(*args)
            finally:
                self.op_s += time.perf_counter() - start

        return timed

    def wrap_forward(self, forward: Any) -> Any:
        def timed(runner: Any, *args: Any, **kwargs: Any) -> Any:
            self.op_s = 0.0
            events = None
            if self.cuda and self.recording:
                import torch

                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            start = time.perf_counter()
            try:
                return forward(runner, *args, **kwargs)
            finally:
                wall = time.perf_counter() - start
                if self.recording:
                    reqs = int(runner.input_batch.num_reqs)
                    tokens = int(runner.query_start_loc.np[reqs])
                    step: dict[str, Any] = {"tokens": tokens, "seqs": reqs, "host_s": wall}
                    step["forward_s"] = wall  # on a GPU, the device's (`resolve`)
                    step["op_s"] = None if self.cuda else self.op_s
                    if events is not None:
                        events[1].record()
                        self.events.append(events)
                    self.steps.append(step)

        return timed


def phase(step: dict[str, Any]) -> tuple[int, str]:
    """A step's kind, with a key that orders prefill first, then decode by batch size."""
    n = step["seqs"]
    if step["tokens"] > n:
        return 0, "prefill"
    return n, f"decode, {n} sequence{'s' if n > 1 else ''}"


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({phase(s) for s in steps}):
        name = key[1]
        chosen = [s for s in steps if phase(s) == key]
        out[name] = {
            "steps": len(chosen),
            "forward_ms_median": 1e3 * statistics.median(s["forward_s"] for s in chosen),
            "host_ms_median": 1e3
            * statistics.median(s.get("host_s", s["forward_s"]) for s in chosen),
        }
        if any(s["op_s"] is None for s in chosen):  # a GPU: the op inside CUDA graphs
            continue
        shares = sorted(s["op_s"] / s["forward_s"] for s in chosen)
        q = statistics.quantiles(shares, n=4) if len(shares) > 1 else shares * 3
        out[name] |= {
            "op_ms_median": 1e3 * statistics.median(s["op_s"] for s in chosen),
            "share_median": statistics.median(shares),
            "share_quartiles": [q[0], q[2]],
            "share_total": sum(s["op_s"] for s in chosen) / sum(s["forward_s"] for s in chosen),
        }
    return out


def dispatch_overhead_us(hidden: int, calls: int = 5000) -> float:
    """Microseconds a call of the op through ``torch.ops`` takes beyond its body called
    directly (median of 5 batches), on one token at a layer nothing steers."""
    import torch

    from gss.serving import vllm_op

    h = torch.randn(1, hidden)
    diffs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            torch.ops.gss.vllm_steer(h, -1)
        op = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(calls):
            vllm_op.steered_block_output(h, -1)
        body = time.perf_counter() - start
        diffs.append(1e6 * (op - body) / calls)
    return statistics.median(diffs)


def measure(args: argparse.Namespace) -> None:
    for key, value in THREAD_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner in this process
    os.environ.pop("GSS_VLLM_ARTIFACTS", None)
    if args.kernel == "torch":
        os.environ["GSS_VLLM_TRITON"] = "0"  # the op's torch form on CUDA too
    import torch

    cuda = torch.cuda.is_available()
    import vllm
    from gss.report import cpu_info
    from gss.serving import vllm_op

    work = Path(args.work)
    info = json.loads((work / "prep.json").read_text())
    plain = args.artifact == "plain"  # no artifact: the engine's forward alone, to compare
    artifact = info["artifacts"]["hard" if plain else args.artifact]
    shape = argparse.Namespace(
        model=info["model"],
        dtype="float32",
        prompt_len=args.prompt_len,
        max_tokens_cap=args.max_tokens,
        gpu_memory_utilization=None,
    )  # the throughput benchmark's engine, serving one artifact as "a"
    llm = make_engine(shape, args.mode, {} if plain else {"a": artifact["dir"]})
    from vllm.v1.worker import gpu_model_runner

    timers = Timers(cuda)
    runner_cls = gpu_model_runner.GPUModelRunner  # the CPU runner inherits its _model_forward
    runner_cls._model_forward = timers.wrap_forward(runner_cls._model_forward)
    hidden = json.loads((Path(info["model"]) / "config.json").read_text())["hidden_size"]
    dispatch_us = None if cuda else dispatch_overhead_us(int(hidden))
    if not cuda:  # on a GPU the op's body runs inside CUDA graphs: no timer of its own
        body = timers.wrap_op(vllm_op.steered_block_output)
        vllm_op.vllm_steer.register_kernel("cpu", body)
    state = vllm_op.STATE
    sp = params(args, None if plain else "a", args.max_tokens)  # greedy, ignore_eos, steered by "a"
    prompts = [p[: args.prompt_len] for p in info["prompts"][: max(args.load, args.batch1)]]

    def run(ids: list[list[int]]) -> None:
        llm.generate([{"prompt_token_ids": p} for p in ids], [sp] * len(ids), use_tqdm=False)

    steered = 0
    steer = state.steer

    def counting(layer: int, h: Any, residual: Any = None) -> Any:  # warm-up only: the op
        nonlocal steered  # does steer these tokens
        assert state.slots is not None
        tokens = h.numel() // h.shape[-1]
        steered += int((state.slots[:tokens] == state.names["a"]).sum())
        return steer(layer, h, residual)

    state.steer = counting  # type: ignore[method-assign]
    run(prompts[:2])  # warm-up outside the record
    replayed = cuda and args.mode == "compiled"  # CUDA graphs replay the op without Python
    if steered == 0 and not plain and not replayed:
        raise SystemExit("the op steered no token in the warm-up: the plugin is not steering")
    state.steer = steer  # type: ignore[method-assign]
    timers.recording = True
    start = time.perf_counter()
    for _ in range(args.rounds):
        for p in prompts[: args.batch1]:
            run([p])
        run(prompts[: args.load])
    wall = time.perf_counter() - start
    timers.resolve()
    result = {
        "mode": args.mode,
        "gate": "plain (no artifact)" if plain else artifact["gate"],
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu": "{cpu} ({cpu_capability}), {n} CPUs".format(n=os.cpu_count(), **cpu_info()),
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "command": "python benchmarks/scripts/vllm_op_share.py " + " ".join(sys.argv[1:]),
        "threads": {k: os.environ.get(k) for k in THREAD_ENV},
        "model": info["model_name"],
        "artifact": None if plain else {k: v for k, v in artifact.items() if k != "dir"},
        "kernel": None if plain else vllm_op.steer_kernels(),
        "workload": {
            "rounds": args.rounds,
            "batch1": args.batch1,
            "load": args.load,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
        },
        "wall_s": wall,
        "dispatch_us": dispatch_us,
        "summary": summary(timers.steps),
        "steps": timers.steps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.artifact + ("-torch" if args.kernel == "torch" and not plain else "")
    (out / f"{args.mode}-{name}.json").write_text(json.dumps(result, indent=1))
    write_table(out)


def write_table(out: Path) -> None:
    (out / "table.md").write_text(table(out))
    print((out / "table.md").read_text())


def table(out: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    lines = [
        "The op's share of vLLM's forward (op seconds / forward seconds, per step), "
        "every request steered (gate `plain`: an engine without the artifact, for its forward). "
        "On a GPU the forward is the device's time (CUDA events), the host's time for the call "
        "beside it, and the op, inside CUDA graphs, is not timed (-).",
        "",
        "| mode | gate | phase | steps | forward ms (median) | host ms (median) "
        "| op ms (median) | share: median [quartiles] | share: total |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        mode = run["mode"] + (f" ({run['device']})" if run.get("device") else "")
        for name, s in run["summary"].items():
            host = s.get("host_ms_median", s["forward_ms_median"])
            if "share_median" in s:
                lo, hi = s["share_quartiles"]
                op = (
                    f"{s['op_ms_median']:.2f} | {100 * s['share_median']:.2f}% "
                    f"[{100 * lo:.2f}-{100 * hi:.2f}%] | {100 * s['share_total']:.2f}%"
                )
            else:
                op = "- | - | -"
            lines.append(
                f"| {mode} | {gate(run)} | {name} | {s['steps']} "
                f"| {s['forward_ms_median']:.3f} | {host:.3f} | {op} |"
            )
    lines += against_plain(runs)
    served = [run for run in runs if run["artifact"]]
    if served:
        r = served[0]
        a = r["artifact"]
        lines += [
            "",
            f"{r['model']}, float32, block {a['layer']}, rank {a['rank']}; "
            f"vLLM {r['vllm']}, torch {r['torch']}; per round {r['workload']['batch1']} "
            f"requests one at a time, then {r['workload']['load']} at once, "
            f"{r['workload']['prompt_len']}-token prompts, {r['workload']['max_tokens']} "
            "greedy tokens each.",
        ]
        timed = [r for r in runs if r.get("dispatch_us") is not None]
        if timed:
            lines += [
                "",
                "The op's dispatch, not in its time above (through `torch.ops` minus the body "
                "called directly, one token): "
                + ", ".join(f"{r['mode']} {r['gate']} {r['dispatch_us']:.1f} us" for r in timed)
                + ".",
            ]
    return "\n".join(lines) + "\n"


def gate(run: dict[str, Any]) -> str:
    """A run's gate, and what the op steered with where it says (Triton or torch's ops)."""
    kernel = run.get("kernel")
    return run["gate"] if not kernel else f"{run['gate']}, {kernel}"


def against_plain(runs: list[dict[str, Any]]) -> list[str]:
    """Per mode and phase: the engine without the artifact's median forward (and host) time
    over the engine with it, where both ran: its speed, 1.0 for no cost."""
    lines: list[str] = []
    for run in runs:
        plain = next((p for p in runs if p["mode"] == run["mode"] and not p["artifact"]), None)
        if plain is None or not run["artifact"]:
            continue
        for name, s in run["summary"].items():
            if name not in plain["summary"]:
                continue
            p = plain["summary"][name]
            host = p.get("host_ms_median", p["forward_ms_median"]) / s.get(
                "host_ms_median", s["forward_ms_median"]
            )
            lines.append(
                f"| {run['mode']} | {gate(run)} | {name} "
                f"| {p['forward_ms_median'] / s['forward_ms_median']:.4f} | {host:.4f} |"
            )
    if not lines:
        return []
    return [
        "",
        "Speed of the engine serving the artifact against the engine without it (median time "
        "per step without / with, by phase; two engines, each timed once):",
        "",
        "| mode | gate | phase | forward | host |",
        "|---|---|---|---|---|",
        *lines,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    ap.add_argument("--work", default=str(WORK), help="vllm_throughput.py prep's directory")
    ap.add_argument(
        "--artifact",
        choices=("hard", "none", "plain"),
        default="hard",
        help="plain: an engine without the plugin's artifact (its forward time; op 0)",
    )
    ap.add_argument(
        "--kernel",
        choices=("auto", "torch"),
        default="auto",
        help="what the op steers with: the plugin's choice (CUDA: its Triton kernel), or "
        "torch's ops (GSS_VLLM_TRITON=0; writes <mode>-<artifact>-torch.json)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch1", type=int, default=2, help="requests one at a time, per round")
    ap.add_argument("--load", type=int, default=16, help="requests at once, per round")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "results/serve-op-share"))
    ap.add_argument(
        "--report",
        action="store_true",
        help="measure nothing: recompute each JSON's summary in --out from its steps, and table.md",
    )
    args = ap.parse_args()
    if args.report:
        out = Path(args.out)
        for path in sorted(out.glob("*.json")):
            run = json.loads(path.read_text())
            run["summary"] = summary(run["steps"])
            path.write_text(json.dumps(run, indent=1))
        write_table(out)
        return
    if args.load > 64 or args.batch1 > 64 or args.prompt_len > 256:
        ap.error("prep made 64 prompts of 256 tokens: --load/--batch1 <= 64, --prompt-len <= 256")
    measure(args)


if __name__ == "__main__":
    main()
