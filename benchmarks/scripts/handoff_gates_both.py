"""The reference where BOTH the steer protect chose and a discriminant condition open (issue 72).

`gss.reference_where_open` hands a step over where *some* gate opens; this measurement patches
its rule, for this process only, so that every member of the stack must open: the steer's
probe gates (results/protect-says/gates/protect, block 22) and the discriminant gate that
`handoff_gates.py` saved (block 16, 1%), with the signal cut of 1 nat. Not a library option:
measured once, results/protect-says/handoff-gates/README.md says what it showed.

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=benchmarks:benchmarks/scripts .venv/bin/python \\
        benchmarks/scripts/handoff_gates_both.py --gate OUT/gates/discriminant-16-0.01 \\
        --out results/protect-says/handoff-gates/both.json
"""

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from protect_says import canary_fine_tune, handed_measures, ordinary_starts

from gss import audit, load
from gss.artifact.stack import SteeringStack
from gss.artifact.steering_artifact import SteeringArtifact
from gss.evaluate.decoding import greedy_generate
from gss.inference.handoff import ReferenceWhereOpen


@contextmanager
def every_gate_must_open() -> Iterator[None]:
    """`ReferenceWhereOpen` opens where every member's gate opened (not any)."""
    original = ReferenceWhereOpen._opened

    def both(self: Any, rows: int, device: torch.device) -> torch.Tensor:
        opened = torch.ones(rows, dtype=torch.bool, device=device)
        for gate in self.gates or []:
            if gate.last is not None and gate.last.shape[0] == rows:
                opened &= gate.last.to(device)
            else:
                opened[:] = False
        return opened

    ReferenceWhereOpen._opened = both  # type: ignore[method-assign]
    try:
        yield
    finally:
        ReferenceWhereOpen._opened = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gate", type=Path, required=True, help="the discriminant gate's artifact")
    parser.add_argument("--out", type=Path, required=True, help="a JSON file")
    args = parser.parse_args()
    c = canary_fine_tune()
    model, base, tokenizer, data, pad = c.model, c.base, c.tokenizer, c.data, c.pad
    k, n, bs, train_rows, ordinary = c.k, c.n, c.bs, c.train_rows, c.ordinary
    report_dir = Path("results/protect-says/gates/protect")
    saved = json.loads((report_dir / "protect.json").read_text())
    report = audit(
        model, base, [list(r) for r in train_rows], k=k, n=n, batch_size=bs, progress=False
    )
    chosen = SimpleNamespace(audit=report, heldout=saved["split"]["heldout"])
    gates = [load(args.gate), load(report_dir / "steer")]
    steer = SteeringStack(tuple(a for a in gates if isinstance(a, SteeringArtifact)))
    plain = greedy_generate(model, ordinary_starts(ordinary), 32, pad_id=pad, batch_size=bs)
    out = {}
    with every_gate_must_open():
        for cut in (1.0,):
            m = handed_measures(
                model, base, steer, chosen, data, tokenizer, pad, ordinary, cut, False, plain
            )
            out[f"signal > {cut:g}"] = m
            print(cut, json.dumps(m, default=float), flush=True)
    args.out.write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
