"""What the vLLM plugin's runner patch costs the CPU on every step (issue 40, point 5).

Before each forward the patch writes every scheduled token's slot (which artifact steers it, or
none) into the buffer the op reads (``gss.serving.vllm_plugin._fill_slots``), where the buffer
does not hold them already. That is Python and NumPy on the host, outside the op's timings in
``vllm_op.py``; on a GPU, where a small model's step is short and the host's work is on its
critical path, it adds to the op's cost (``vllm_op_share.py`` on an H200 found it there). This
times it on a stand-in runner (the attributes vLLM's ``GPUModelRunner`` has), per batch shape,
three ways for the V1 runner: a request's first step, when its slot is looked up from its
sampling parameters; a later step, when the slot kept on the request is read, whose slots the
buffer did not hold; and a later step whose slots it did (a steady decode batch); and, for
vLLM's Model Runner V2, a step after ``prepare_inputs`` (the slots kept by request id since
``add_requests``), written or unchanged as for V1. Beside each shape, where
``results/serve-cuda-op`` has it, the H200's CUDA-graph forward of SmolLM2-135M's shape at that
shape and the op's cost there: the fill's share of that forward is an estimate across two
machines (the fill timed on this CPU without the CUDA calls, the forward on the H200).

    .venv/bin/python benchmarks/scripts/vllm_fill_slots.py --out results/serve-fill-slots
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from gss.serving import vllm_op, vllm_plugin

SHAPES = [(1, 1), (16, 1), (64, 1), (256, 1), (1, 512), (16, 32)]  # (sequences, tokens each)
ARMS = [  # V1 steps: (name, a request's first step, the buffer held other slots)
    ("first_step_us", True, True),
    ("later_step_us", False, True),
    ("steady_step_us", False, False),
]
CUDA_OP = Path(__file__).resolve().parents[2] / "results/serve-cuda-op/results.json"


def runner(sequences: int, tokens: int) -> Any:
    """A stand-in for vLLM's model runner at one step: every other request steered."""
    extra = {vllm_plugin.EXTRA_ARG: "a"}
    requests = {
        f"r{i}": SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args=extra if i % 2 else None)
        )
        for i in range(sequences)
    }
    return SimpleNamespace(
        device=torch.device("cpu"),
        max_num_tokens=max(512, sequences * tokens),
        requests=requests,
        input_batch=SimpleNamespace(num_reqs=sequences, req_ids=list(requests)),
        query_start_loc=SimpleNamespace(
            np=np.arange(0, (sequences + 1) * tokens, tokens, dtype=np.int32)
        ),
    )


class RunnerV2:
    """A stand-in for Model Runner V2 at one step, patched as the plugin patches V2: its
    ``prepare_inputs`` returns the step's batch, ``execute_model`` prepares it (the plugin
    fills the slots there)."""

    def __init__(self, sequences: int, tokens: int) -> None:
        self.device = torch.device("cpu")
        self.max_num_tokens = max(512, sequences * tokens)
        self.model = SimpleNamespace(_gss_installed=True)
        ids = [f"r{i}" for i in range(sequences)]
        self.batch = SimpleNamespace(
            num_reqs=sequences,
            req_ids=ids,
            query_start_loc_np=np.arange(0, (sequences + 1) * tokens, tokens, dtype=np.int32),
        )
        extra = {vllm_plugin.EXTRA_ARG: "a"}
        new = [
            SimpleNamespace(
                req_id=r, sampling_params=SimpleNamespace(extra_args=extra if i % 2 else None)
            )
            for i, r in enumerate(ids)
        ]
        self.add_requests(SimpleNamespace(scheduled_new_reqs=new))

    def load_model(self) -> None: ...

    def add_requests(self, scheduler_output: Any) -> None: ...

    def _remove_request(self, req_id: str) -> None: ...

    def prepare_inputs(self) -> Any:
        return self.batch

    def execute_model(self) -> None:
        self.prepare_inputs()


def v2_step_us(sequences: int, tokens: int, changed: bool, steps: int, rounds: int) -> list[float]:
    """Microseconds per Model Runner V2 step (the fill after ``prepare_inputs``), per round;
    the requests added before. ``changed`` as in `step_us`."""
    runner = RunnerV2(sequences, tokens)
    state = vllm_op.STATE
    out = []
    for _ in range(rounds):
        runner.execute_model()  # warm
        started = time.perf_counter()
        for _ in range(steps):
            if changed:  # another step's slots in the buffer, and another batch before
                state.held, state.batch = b"", None
            runner.execute_model()
        out.append((time.perf_counter() - started) / steps * 1e6)
    return out


def step_us(make: Any, fresh: bool, changed: bool, steps: int, rounds: int) -> list[float]:
    """Microseconds per V1 step (what the patch does before the forward), per round: a
    request's first step (``fresh``: new requests, whose slots are looked up) or a later one;
    ``changed``: the buffer held other slots (forgotten before each step, so the step writes
    its own), else the last step's own (a steady decode batch: nothing to write)."""
    state = vllm_op.STATE
    out = []
    for _ in range(rounds):
        runners = [make() for _ in range(steps)] if fresh else [make()] * steps
        vllm_plugin._fill_slots(runners[0])  # warm (and, not fresh, the slots kept)
        started = time.perf_counter()
        for r in runners:
            if changed:  # another step's slots in the buffer, and another batch before
                state.held, state.batch = b"", None
            if fresh:  # new requests: the runner's _update_states forgets the last batch
                vllm_plugin.forget_batch()
            vllm_plugin._fill_slots(r)
        out.append((time.perf_counter() - started) / steps * 1e6)
    return out


def cuda_forward() -> dict[tuple[int, int], dict[str, float]]:
    """The H200's CUDA-graph forward (ms) and the hard-gated op's cost (1 - speed) by shape."""
    if not CUDA_OP.is_file():
        return {}
    found = {}
    for row in json.loads(CUDA_OP.read_text())["shapes"]:
        graph = row["ms"]["graph"]
        found[tuple(row["shape"])] = {
            "forward_ms": graph["plain"]["median"],
            "op_cost": 1 - row["speed_vs_plain"]["graph"]["op, steered"]["median"],
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/serve-fill-slots"))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    state = vllm_op.State()
    state.names, state.loaded = {"a": 0}, True
    vllm_op.STATE = state
    vllm_plugin._patch_v2_runner_class(RunnerV2)
    torch.set_num_threads(1)
    gpu = cuda_forward()
    rows = []
    for sequences, tokens in SHAPES:
        state.buffer(max(512, sequences * tokens), torch.device("cpu"))
        row: dict[str, Any] = {"sequences": sequences, "tokens_each": tokens}
        for name, fresh, changed in ARMS:
            times = step_us(
                lambda s=sequences, t=tokens: runner(s, t), fresh, changed, args.steps, args.rounds
            )
            row[name] = statistics.median(times)
            row[name.replace("_us", "_rounds_us")] = times
        for name, changed in (("v2_step_us", True), ("v2_steady_us", False)):
            times = v2_step_us(sequences, tokens, changed, args.steps, args.rounds)
            row[name] = statistics.median(times)
            row[name.replace("_us", "_rounds_us")] = times
        if (sequences, tokens) in gpu:
            forward = gpu[(sequences, tokens)]
            row["h200_graph_forward_ms"] = forward["forward_ms"]
            row["h200_op_cost"] = forward["op_cost"]
            row["fill_share_of_h200_forward"] = row["later_step_us"] / (forward["forward_ms"] * 1e3)
        rows.append(row)
        print(
            f"{sequences} x {tokens}: first step {row['first_step_us']:.1f} us, later steps "
            f"{row['later_step_us']:.1f} us, unchanged {row['steady_step_us']:.1f} us, "
            f"Model Runner V2 {row['v2_step_us']:.1f} us, unchanged {row['v2_steady_us']:.1f} us",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "benchmarks/scripts/vllm_fill_slots.py "
        + f"--steps {args.steps} --rounds {args.rounds}",
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": 1,
    }
    (args.out / "results.json").write_text(json.dumps({**meta, "shapes": rows}, indent=1) + "\n")
    write_table(args.out / "table.md", rows, args)
    plot(args.out / "fill.png", rows)


def write_table(path: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    lines = [
        "# The runner patch's slot fill, per step (host CPU)",
        "",
        f"`benchmarks/scripts/vllm_fill_slots.py --steps {args.steps} --rounds {args.rounds}` "
        "on this machine (2 CPU cores, one torch thread); a stand-in runner, every other request "
        "steered; medians of the rounds. V1 runner, what the patch does before a forward: a "
        "request's first step looks its slot up and writes the batch's slots; a later step "
        "reads the slot kept on the request and writes them; unchanged: a later step whose "
        "slots the buffer holds already (a steady decode batch), which writes nothing; Model "
        "Runner V2: a step, the slots kept by request id since the request was added, "
        "written, or unchanged as above (a stand-in V2 runner patched as the plugin "
        "patches V2). H200 columns: `results/serve-cuda-op` (CUDA-graph forward of "
        "SmolLM2-135M's shape, bfloat16, and the hard-gated op's cost in it); the share is "
        "this CPU's later step (written) over that forward, an estimate across machines that "
        "leaves out the CUDA calls (on a GPU a written step adds one copy to the device).",
        "",
        "| sequences x tokens | first step (us) | later steps (us) | unchanged (us) "
        "| V2, written (us) | V2, unchanged (us) | H200 forward (ms) | op's cost there "
        "| fill / forward | op + fill |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gpu = "h200_graph_forward_ms" in r
        lines.append(
            f"| {r['sequences']} x {r['tokens_each']} | {r['first_step_us']:.1f} "
            f"| {r['later_step_us']:.1f} | {r['steady_step_us']:.1f} | {r['v2_step_us']:.1f} "
            f"| {r['v2_steady_us']:.1f} "
            + (
                f"| {r['h200_graph_forward_ms']:.2f} | {100 * r['h200_op_cost']:.2f}% "
                f"| {100 * r['fill_share_of_h200_forward']:.2f}% "
                f"| {100 * (r['h200_op_cost'] + r['fill_share_of_h200_forward']):.2f}% |"
                if gpu
                else "| | | | |"
            )
        )
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['sequences']}x{r['tokens_each']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = [
        ("first_step_us", "first step (slot looked up)"),
        ("later_step_us", "later steps (slot kept)"),
        ("steady_step_us", "unchanged slots (nothing written)"),
        ("v2_step_us", "Model Runner V2, written"),
        ("v2_steady_us", "Model Runner V2, unchanged"),
    ]
    for i, (key, label) in enumerate(bars):
        ax.bar(x + 0.16 * (i - 2), [r[key] for r in rows], 0.16, label=label)
    ax.set_xticks(x, labels)
    ax.set_xlabel("sequences x tokens each")
    ax.set_ylabel("us per step (this CPU)")
    ax.set_title("vLLM plugin: the slot fill per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
