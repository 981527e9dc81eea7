"""The attacker who samples against greedy decoding on a cached canary fine-tune (issue 70):
`gss.audit` on the rows protect audits, and the rows 100 draws reproduce that greedy does not.

    python benchmarks/scripts/audit_sampled.py --variant plain|lora|chat
"""

from __future__ import annotations

import argparse
import json

from protect_says import canary_fine_tune

from gss import audit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="plain", choices=("plain", "lora", "chat"))
    args = parser.parse_args()
    c = canary_fine_tune(args.variant)
    report = audit(
        c.model, c.base, c.train_rows, tokenizer=c.tokenizer, k=c.k, n=c.n, progress=False
    )
    print(report.headline())
    summary = report.summary()
    keys = ("rows", "checkable", "extractable", "memorized", "memorized_interval", "sampled")
    print(json.dumps({key: summary[key] for key in keys}, indent=1))
    greedy = {row.index for row in report.memorized}
    more = [
        r
        for r in report.rows
        if r.sample_extractable() and r.index not in greedy and not r.reference_extractable
    ]
    print(f"rows 100 draws reproduce that greedy decoding does not: {len(more)}")


if __name__ == "__main__":
    main()
