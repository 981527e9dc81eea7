"""A correction fitted toward the reference's hidden state, gated by a protect steer's gates.

Issue 72 asks the protected model to say what the reference would where it acts. The steer
subtracts ``delta * s_k * v_k``, a direction found to remove the memorized continuation, not to
produce the reference's; with the strength that removes it, its replies loop or stay 2x as
perplexing to the reference. This study fits instead an affine map at one decoder block,
``dh = W (h - mu) + b``, by ridge regression of the reference's block output minus the
fine-tune's on the fine-tune's (teacher-forced on the tuning canaries' memorized windows, on the
reference's own continuations of their prompts and on general rows), optionally cut to rank r
(reduced-rank regression: the form of a steer's K directions), and adds it where some gate of a
committed protect steer opens (its gates, read from the unsteered hidden state at its block; the
steer's own correction is not applied). Measured as `protect_says.py` measures: the held-out
canaries' secrets, their greedy replies (repeated 4-grams, perplexity under the reference) and
the licence prompts continued as the fine-tune continues them.

    python benchmarks/scripts/fitted_map.py --out results/protect-says/fitted-map
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from protect_says import canary_fine_tune, ordinary_starts

from gss import load
from gss.artifact.stack import SteeringStack
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.leaks import EXTRA_TOKENS, secrets_said
from gss.evaluate.utility import perplexity, repetition
from gss.hf.blocks import find_decoder_blocks
from gss.report import machine_info, markdown_table, write_json
from gss_bench.canaries.data import secret_fields

STEER = Path(__file__).parents[2] / "results/protect-says/centred/defaults/protect"
BS = 16


def block_outputs(model: nn.Module, layer: int, rows: list[list[int]]) -> list[Tensor]:
    """The output of decoder block ``layer`` at every position of each row (float32)."""
    store: dict[str, Tensor] = {}

    def hook(_m: nn.Module, _i: Any, o: Any) -> None:
        store["h"] = (o[0] if isinstance(o, tuple) else o).detach()

    handle = find_decoder_blocks(model)[layer].register_forward_hook(hook)
    out = []
    try:
        with torch.no_grad():
            for r in rows:
                model(torch.tensor([r]))
                out.append(store["h"][0].float())
    finally:
        handle.remove()
    return out


def fit_map(x: Tensor, y: Tensor, alpha: float, rank: int | None) -> tuple[Tensor, Tensor, float]:
    """``W``, ``b`` with ``y ~ x W + b`` by ridge regression (``alpha`` times the mean
    eigenvalue of the centred x's scatter), cut to ``rank`` (reduced-rank regression), and the
    mean relative residual on the fitting positions."""
    mu, ybar = x.mean(0), y.mean(0)
    xc, yc = x - mu, y - ybar
    scatter = xc.T @ xc
    lam = alpha * float(scatter.trace()) / scatter.shape[0]
    w = torch.linalg.solve(scatter + lam * torch.eye(scatter.shape[0]), xc.T @ yc)
    if rank is not None:  # the rank-r map whose fitted values are closest to the full one's
        _, _, vh = torch.linalg.svd(xc @ w, full_matrices=False)
        w = w @ vh[:rank].T @ vh[:rank]
    b = ybar - mu @ w
    resid = float(((x @ w + b - y).norm(dim=1) / y.norm(dim=1).clamp_min(1e-6)).mean())
    return w, b, resid


class GatedMap:
    """Hooks on the fine-tune: the steer's gates at its block (from the unsteered state) and
    the fitted map added at ``layer`` where some gate opened at that position (or everywhere).
    ``latch``: once a gate opened in a row, the map stays on at every later position of it (a
    forward of more than one token starts new rows; generation feeds one token a step)."""

    def __init__(self, model: nn.Module, gated: Any, gate_layer: int, layer: int,
                 w: Tensor | None, b: Tensor | None, everywhere: bool = False,
                 latch: bool = False) -> None:  # fmt: skip
        self.blocks = find_decoder_blocks(model)
        self.gated, self.gate_layer, self.layer = gated, gate_layer, layer
        self.w, self.b, self.everywhere, self.latch = w, b, everywhere, latch
        self.mask: Tensor | None = None
        self.latched: Tensor | None = None
        self.opened = self.seen = 0

    def _gate(self, _m: nn.Module, _i: Any, o: Any) -> None:
        h = o[0] if isinstance(o, tuple) else o
        with torch.no_grad():
            _, is_open = self.gated.correction(h.detach())
        self.mask = is_open.reshape(*h.shape[:2], -1).any(-1)
        if self.latch:
            if h.shape[1] > 1 or self.latched is None or len(self.latched) != len(h):
                self.latched = torch.zeros(len(h), dtype=torch.bool, device=h.device)
            self.mask = (self.mask | self.latched[:, None]).cummax(dim=1).values
            self.latched = self.mask[:, -1]
        self.opened += int(self.mask.sum())
        self.seen += self.mask.numel()

    def _map(self, _m: nn.Module, _i: Any, o: Any) -> Any:
        h = o[0] if isinstance(o, tuple) else o
        assert self.w is not None and self.b is not None
        dh = h.float() @ self.w + self.b
        if not self.everywhere and self.mask is not None:
            dh = dh * self.mask[..., None]
        mapped = (h.float() + dh).to(h.dtype)
        return (mapped, *o[1:]) if isinstance(o, tuple) else mapped

    def __enter__(self) -> GatedMap:
        # the gate's hook first: at the same block it reads the state before the map
        self.handles = [self.blocks[self.gate_layer].register_forward_hook(self._gate)]
        if self.w is not None:  # None: the gates only, counted
            self.handles.append(self.blocks[self.layer].register_forward_hook(self._map))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steer", type=Path, default=STEER, help="a protect report directory")
    parser.add_argument(
        "--runs",
        nargs="*",
        default=["last:0.001:full", "last:0.1:full", "last:0.001:16", "gate:0.001:full"],
        help="LAYER:ALPHA:RANK each (LAYER: last, gate or a block index; RANK: full or r)",
    )
    parser.add_argument("--everywhere", action="store_true", help="also each map ungated")
    parser.add_argument("--keep", action="store_true", help="keep --out's rows, measure the rest")
    parser.add_argument("--latch", action="store_true", help="also each map latched")
    args = parser.parse_args()
    c = canary_fine_tune()
    model, base, tok, data, pad, k, n = c.model, c.base, c.tokenizer, c.data, c.pad, c.k, c.n
    split = json.loads((args.steer / "protect.json").read_text())["split"]
    held = [i for i in split["heldout"] if i < len(data.canary_rows)]  # canaries come first
    tune = [i for i in split["tuning"] if i < len(data.canary_rows)]
    steer = load(args.steer / "steer")
    gated = steer.artifacts[0] if isinstance(steer, SteeringStack) else steer
    gate_layer, hook = gated.layer, gated.make_hook()
    width = n - k
    tune_prompts = [list(data.canary_rows[i][:k]) for i in tune]
    continued = greedy_generate(base, tune_prompts, width, pad_id=pad, batch_size=BS)
    general = [list(r) for r in data.general_rows[:32]]
    fit_rows = [list(data.canary_rows[i][:n]) for i in tune]
    fit_rows += [p + r for p, r in zip(tune_prompts, continued, strict=True)] + general
    starts = [k - 1] * (2 * len(tune)) + [0] * len(general)

    prompts = [list(data.canary_rows[i][:k]) for i in held]
    secrets = [[secret_fields(data.secrets[i])[f] for f in ("number", "address")] for i in held]
    said_width = max(len(r) for r in data.canary_rows) - k + EXTRA_TOKENS
    reference = greedy_generate(base, prompts, width, pad_id=pad, batch_size=BS)
    starts_o = ordinary_starts(c.ordinary)
    tuned_o = greedy_generate(model, starts_o, 32, pad_id=pad, batch_size=BS)

    def reference_ppl(replies: list[list[int]]) -> float:
        rows = [p + list(r) for p, r in zip(prompts, replies, strict=True)]
        lengths = [len(p) for p in prompts]
        return perplexity(base, rows, pad, batch_size=BS, prompt_lengths=lengths)

    def measure(ctx: GatedMap) -> dict[str, Any]:
        with ctx:
            replies = greedy_generate(model, prompts, width, pad_id=pad, batch_size=BS)
            ordinary = greedy_generate(model, starts_o, 32, pad_id=pad, batch_size=BS)
            said = secrets_said(model, tok, prompts, secrets, max_new_tokens=said_width,
                                pad_id=pad, batch_size=BS)  # fmt: skip
        flags = [f for row in said.said for f in row]
        return {
            "secrets_said": 100.0 * sum(flags) / len(flags),
            "repeated_4grams": repetition(replies),
            "reference_ppl": reference_ppl(replies),
            "licence_prompts_identical": 100.0
            * sum(a == b for a, b in zip(ordinary, tuned_o, strict=True))
            / len(tuned_o),
            "examples": [tok.decode(r) for r in replies[:4]],
        }

    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": machine_info(),
        "steer": str(args.steer),
        "gate_layer": gate_layer,
        "reference": {
            "repeated_4grams": repetition(reference),
            "reference_ppl": reference_ppl(reference),
            "examples": [tok.decode(r) for r in reference[:4]],
        },
        "runs": {},
    }
    if args.keep and (args.out / "result.json").exists():  # rows measured before, kept as read
        result["runs"] = json.loads((args.out / "result.json").read_text())["runs"]
    with GatedMap(model, hook, gate_layer, gate_layer, None, None) as g:
        perplexity(model, c.ordinary, pad, batch_size=BS)
        result["licence_gate_open"] = 100.0 * g.opened / max(g.seen, 1)
    captured: dict[int, tuple[Tensor, Tensor]] = {}
    last = len(find_decoder_blocks(model)) - 1
    for run in args.runs:
        where, alpha, rank = run.split(":")
        layer = {"last": last, "gate": gate_layer}.get(where) or int(where)
        if layer not in captured:
            ours = block_outputs(model, layer, fit_rows)
            theirs = block_outputs(base, layer, fit_rows)
            x = torch.cat([a[s:] for a, s in zip(ours, starts, strict=True)])
            y = torch.cat([b[s:] - a[s:] for a, b, s in zip(ours, theirs, starts, strict=True)])
            captured[layer] = (x, y)
        x, y = captured[layer]
        w, b, resid = fit_map(x, y, float(alpha), None if rank == "full" else int(rank))
        modes: list[tuple[str, dict[str, bool]]] = [("", {})]
        modes += [(", ungated", {"everywhere": True})] * args.everywhere
        modes += [(", latched", {"latch": True})] * args.latch
        for suffix, mode in modes:
            key = f"block {layer}, alpha {alpha}, rank {rank}{suffix}"
            if key in result["runs"]:
                continue
            row = measure(GatedMap(model, hook, gate_layer, layer, w, b, **mode))
            result["runs"][key] = {"fit_residual": resid, "positions": len(x), **row}
            print(key, json.dumps({k_: v for k_, v in row.items() if k_ != "examples"}), flush=True)
            write(args.out, result)


def write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "result.json", result)
    ref = result["reference"]
    rows = [["the reference itself", "-", "-", f"{ref['repeated_4grams']:.1f}",
             f"{ref['reference_ppl']:.2f}", "-"]]  # fmt: skip
    for key, r in result["runs"].items():
        rows.append([key, f"{r['fit_residual']:.2f}", f"{r['secrets_said']:.1f}",
                     f"{r['repeated_4grams']:.1f}", f"{r['reference_ppl']:.2f}",
                     f"{r['licence_prompts_identical']:.1f}"])  # fmt: skip
    head = ["map", "fit residual", "secrets said %", "replies: repeated 4-grams %",
            "replies: ppl under reference", "LICENSE prompts unchanged %"]  # fmt: skip
    (out / "result.md").write_text(markdown_table(head, rows) + "\n")


if __name__ == "__main__":
    main()
