"""Why served requests differ from transformers + gss.steer, after `vllm_throughput.py report`
(here, in the gss environment): for each steered load request of the last round whose tokens
differ, the reference's logit gap at the first differing step (a near-tie in the logits: the
served token is the reference's second best, a hair below) and the closest any hard gate came
to its threshold on the tokens up to there (a near-tie in a gate: GPU and CPU float32 put one
response on either side of its threshold, and that token is steered in one and not the other).

    python benchmarks/vllm_gpu/ties.py --work W --results DIR/results.json --out DIR/ties.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import gss
from gss.hf.blocks import resolve_layer


def block_output(model: torch.nn.Module, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """Block `layer`'s output on `ids`, unsteered: what its gates read (a steer at the block
    changes nothing up to it)."""
    _, block = resolve_layer(model, layer)
    kept: list[torch.Tensor] = []

    def keep(module: Any, args: Any, out: Any) -> None:
        kept.append((out[0] if isinstance(out, tuple) else out).detach())

    handle = block.register_forward_hook(keep)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return kept[0]


def explain(work: Path, results: dict[str, Any]) -> dict[str, Any]:
    info = json.loads((work / "prep.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.float32).eval()
    found: dict[str, Any] = {}
    for run in results["runs"]:
        bench = json.loads((work / f"bench-{run}.json").read_text())
        prompts = bench["prompts"]["load"]
        for arm in ("hard", "none"):
            served = bench["rounds"][-1][f"{arm}/steered"]["tokens"]
            diffs = results["equal_to_transformers"][f"{run} {arm}/steered"]["first_difference_at"]
            art = gss.load(info["artifacts"][arm]["dir"])
            assert isinstance(art, gss.SteeringArtifact)  # prep makes one block's steer
            hook = art.make_hook()
            rows = []
            for i, at in enumerate(diffs):
                if at is None:
                    continue
                ids = torch.tensor([prompts[i] + served[i][:at]])
                with gss.steer(model, art), torch.no_grad():
                    logits = model(ids).logits[0, -1]
                top = torch.topk(logits, 2)
                token = served[i][at]
                row = {
                    "request": i,
                    "first_difference_at": at,
                    "reference_top2_gap": float(top.values[0] - top.values[1]),
                    "served_below_top": float(top.values[0] - logits[token]),
                    "served_is_second_best": token == int(top.indices[1]),
                }
                if art.config.gate == "hard":
                    s = hook.responses(block_output(model, art.layer, ids)[0])
                    eps = hook._params(s.device)["thresholds"]
                    rel = ((s.abs() - eps) / eps).abs()
                    row["closest_gate_relative"] = float(rel.min())
                    row["closest_gate_position"] = int(rel.min(-1).values.argmin())
                    row["positions"] = int(s.shape[0])
                rows.append(row)
            found[f"{run} {arm}/steered"] = rows
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    found = explain(args.work, json.loads(args.results.read_text()))
    args.out.write_text(json.dumps(found, indent=1) + "\n")
    for name, rows in found.items():
        gaps = [r["reference_top2_gap"] for r in rows if r["served_is_second_best"]]
        gates = [r for r in rows if not r["served_is_second_best"]]
        print(
            f"{name}: {len(rows)} differ; {len(gaps)} logit near-ties (served = second best, "
            f"gap median {statistics.median(gaps) if gaps else float('nan'):.2e}, "
            f"max {max(gaps, default=float('nan')):.2e}); others: "
            + ", ".join(
                f"request {r['request']} gate {r.get('closest_gate_relative', float('nan')):.1e} "
                f"from its threshold at position {r.get('closest_gate_position')}"
                f"/{r.get('positions')}"
                for r in gates
            )
        )


if __name__ == "__main__":
    main()
