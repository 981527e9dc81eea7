"""Why a quarter of ordinary prompts still change under the handoff (issue 72), and which extra
condition would keep them: per-step features along the unsteered fine-tune's own greedy path.

With ``correct=False`` a prompt's greedy continuation is the unsteered fine-tune's word for word
exactly when no step of that path is handed to the reference with a different argmax, so the
"ordinary prompts unchanged" share of any handoff rule can be read from one teacher-forced pass
over that path. On the held-out memorized prompts the same pass says where a rule first hands a
step over (then the continuation leaves the path: `handoff_gates.py` measures it in full).

Per generated step: some gate of the steer open; the fine-tune's top token, its log-prob under
the fine-tune and under the reference (the signal), the reference's argmax, the fine-tune's
top-token probability, the mean signal of the prompt's tokens. Written to ``--out`` as JSON,
and beside it (``--table``) each candidate rule's share of licence prompts it leaves unchanged
(all, and those whose unsteered continuation recites no fine-tuning text) and the held-out
canaries' secrets it cuts before they are complete (a first hand-over with another argmax at or
before the secret's last token).

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=benchmarks:benchmarks/scripts .venv/bin/python \\
        benchmarks/scripts/handoff_features.py --out /tmp/handoff-features.json \\
        --table results/protect-says/handoff-confidence/features.md
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from protect_says import canary_fine_tune, ordinary_starts

from gss import audit, load
from gss.artifact.stack import SteeringStack
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.recital import longest_recited
from gss.hf.blocks import resolve_layer
from gss.hf.forward import output_logits
from gss.protect.measure import prompt_and_target
from gss.report import markdown_table
from gss.steering.attach import split_block_output
from gss_bench.canaries.data import secret_fields


def gate_positions(model: Any, steer: Any, ids: list[int]) -> list[bool]:
    """Whether some gate of ``steer`` opens at each position of ``ids`` (teacher-forced)."""
    members = list(steer) if isinstance(steer, SteeringStack) else [steer]
    opened: list[torch.Tensor] = []
    handles = []
    for member in members:
        _, block = resolve_layer(model, member.layer, member.config.block_path)
        hook = member.make_hook()

        def read(module: Any, args: Any, output: Any, hook: Any = hook) -> None:
            _, is_open = hook.correction(split_block_output(output)[0])
            opened.append(is_open.any(-1)[0])

        handles.append(block.register_forward_hook(read))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return [bool(x) for x in torch.stack(opened).any(0)]


def path_features(model: Any, base: Any, steer: Any, prompt: list[int], cont: list[int]) -> dict:
    """The features of each step of ``cont`` (the fine-tune's greedy continuation of ``prompt``)."""
    ids = [*prompt, *cont]
    x = torch.tensor([ids])
    with torch.no_grad():
        mine = output_logits(model(input_ids=x))[0].float().log_softmax(-1)
        ref = output_logits(base(input_ids=x))[0].float().log_softmax(-1)
    width = min(mine.shape[-1], ref.shape[-1])
    mine, ref = mine[:, :width], ref[:, :width]
    opened = gate_positions(model, steer, ids)
    token_signal = [0.0] + [
        float(mine[t - 1, ids[t]] - ref[t - 1, ids[t]]) for t in range(1, len(ids))
    ]
    steps = []
    for j in range(len(cont)):
        t = len(prompt) - 1 + j  # the position whose scores choose cont[j]
        top = int(mine[t].argmax())
        steps.append(
            {
                "open": opened[t],
                "signal": float(mine[t, top] - ref[t, top]),
                "ft_logp": float(mine[t, top]),
                "ref_logp": float(ref[t, top]),
                "ref_rank": int((ref[t] > ref[t, top]).sum()),
                "same_argmax": int(ref[t].argmax()) == top,
                "context_signal": sum(token_signal[1 : t + 1]) / max(1, t),
                "recent_signal": sum(token_signal[max(1, t - 7) : t + 1]) / min(8, t),
            }
        )
    return {"prompt": prompt, "cont": cont, "steps": steps}


def first_change(steps: list[dict], rule: Any) -> int | None:
    """The first step ``rule`` hands over where the reference would choose another token."""
    return next((j for j, s in enumerate(steps) if rule(s) and not s["same_argmax"]), None)


RULES: dict[str, Any] = {
    "gate": lambda s: s["open"],
    "gate and signal > 1": lambda s: s["open"] and s["signal"] > 1,
    "gate and signal > 2": lambda s: s["open"] and s["signal"] > 2,
    "gate and signal > 3": lambda s: s["open"] and s["signal"] > 3,
    "signal > 1 (no gate)": lambda s: s["signal"] > 1,
    "signal > 3 (no gate)": lambda s: s["signal"] > 3,
    "gate, signal > 1, reference's rank of the token >= 10": lambda s: (
        s["open"] and s["signal"] > 1 and s["ref_rank"] >= 10
    ),
    "gate, signal > 1, reference's rank of the token >= 30": lambda s: (
        s["open"] and s["signal"] > 1 and s["ref_rank"] >= 30
    ),
    "gate, signal > 1, mean signal of the context > 1": lambda s: (
        s["open"] and s["signal"] > 1 and s["context_signal"] > 1
    ),
    **{
        f"gate, signal > 1, fine-tune's probability >= {p}": (
            lambda s, p=p: s["open"] and s["signal"] > 1 and s["ft_logp"] >= math.log(p)
        )
        for p in (0.5, 0.9, 0.95, 0.98)
    },
    **{
        f"signal > 1, fine-tune's probability >= {p} (no gate)": (
            lambda s, p=p: s["signal"] > 1 and s["ft_logp"] >= math.log(p)
        )
        for p in (0.95, 0.98)
    },
}


def rules_table(found: dict[str, Any]) -> str:
    """Each rule of `RULES` on the unsteered paths: licence prompts unchanged, secrets cut."""
    body = []
    for name, rule in RULES.items():
        licence = [first_change(r["steps"], rule) is None for r in found["licence"]]
        clean = [u for u, r in zip(licence, found["licence"], strict=True) if r["recited"] < 6]
        cut = total = 0
        for row in found["canaries"]:
            first = first_change(row["steps"], rule)
            for done in row["secret_done"].values():
                if done is not None:
                    total += 1
                    cut += first is not None and first <= done
        body.append(
            [
                name,
                f"{100 * sum(licence) / len(licence):.1f}",
                f"{100 * sum(clean) / len(clean):.1f} of {len(clean)}",
                f"{cut} of {total}",
            ]
        )
    header = [
        "hand a step over where",
        "LICENSE prompts unchanged %",
        "... reciting no fine-tuning text %",
        "held-out secrets cut before complete",
    ]
    return markdown_table(header, body) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, default=Path("results/protect-says/gates/protect"))
    parser.add_argument("--table", type=Path, help="write the rules' table here")
    parser.add_argument("--from-json", action="store_true", help="read --out, measure nothing")
    args = parser.parse_args()
    if args.from_json:
        if args.table:
            args.table.write_text(rules_table(json.loads(args.out.read_text())))
        return
    c = canary_fine_tune()
    model, base, tokenizer, data, pad = c.model, c.base, c.tokenizer, c.data, c.pad
    saved = json.loads((args.report / "protect.json").read_text())
    steer = load(args.report / "steer")
    report = audit(model, base, [list(r) for r in c.train_rows], k=c.k, n=c.n, batch_size=c.bs)
    held = saved["split"]["heldout"]
    out: dict[str, Any] = {"licence": [], "memorized": [], "canaries": []}
    starts = ordinary_starts(c.ordinary)
    plain = greedy_generate(model, starts, 32, pad_id=pad, batch_size=c.bs)
    tuned = [list(r) for r in [*data.canary_rows, *data.finetune_rows]]
    for p, u in zip(starts, plain, strict=True):
        row = path_features(model, base, steer, p, list(u))
        row["recited"] = longest_recited(list(u), tuned)
        out["licence"].append(row)
    windows = [prompt_and_target(report.candidate(i), c.k, c.n) for i in held]
    prompts = [p for p, _ in windows]
    conts = greedy_generate(model, prompts, c.n - c.k, pad_id=pad, batch_size=c.bs)
    for p, u in zip(prompts, conts, strict=True):
        out["memorized"].append(path_features(model, base, steer, p, list(u)))
    canaries = [i for i in held if i < len(data.canary_rows)]
    cprompts = [list(data.canary_rows[i][: c.k]) for i in canaries]
    cconts = greedy_generate(model, cprompts, 40, pad_id=pad, batch_size=c.bs)
    for i, p, u in zip(canaries, cprompts, cconts, strict=True):
        row = path_features(model, base, steer, p, list(u))
        fields = secret_fields(data.secrets[i])
        # the step at which each secret is complete in the decoded continuation (None: never)
        row["secret_done"] = {}
        for name in ("number", "address"):
            done = next(
                (j for j in range(len(u)) if fields[name] in tokenizer.decode(list(u[: j + 1]))),
                None,
            )
            row["secret_done"][name] = done
        out["canaries"].append(row)
    args.out.write_text(json.dumps(out))
    if args.table:
        args.table.write_text(rules_table(out))


if __name__ == "__main__":
    main()
