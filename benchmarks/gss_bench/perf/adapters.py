"""Memory of calibrating an adapter (LoRA) fine-tune: its base loaded again vs `adapters_off`.

Peaks are process-wide high-water marks, so each arm runs in a fresh interpreter
(``python -m gss_bench.perf.adapters --reference R``): it builds the base (the tiny Llama, or
``--model``), puts a seeded LoRA on it, gets the reference (a second copy of the base, or
``gss.adapters_off(model)``: the same weights with the adapters off), runs both once so every
weight is resident, calibrates, and prints one JSON line: the peak with the models resident,
the peak after calibration, calibrate's seconds and a checksum of the artifact, which must be
the same in both arms.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gss.report import markdown_table
from gss_bench.perf.common import QUICK, Sizes, log, peak_rss_mb, run_child

REFERENCES = ("loaded", "adapters-off")
LORA_TARGETS = ["q_proj", "v_proj"]


def child(argv: Sequence[str] | None = None) -> int:
    """One calibration against one kind of reference; prints a JSON line."""
    p = argparse.ArgumentParser(prog="python -m gss_bench.perf.adapters")
    p.add_argument("--reference", choices=REFERENCES, required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    import peft
    import torch

    from gss.calibrate import calibrate
    from gss.hf.adapters import adapters_off
    from gss.hf.blocks import find_decoder_blocks
    from gss.hf.forward import forward_logits, vocab_size
    from gss_bench.perf.common import random_ids, tiny_model
    from gss_bench.perf.overhead import load_local_model

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()

    def base_model() -> torch.nn.Module:
        return load_local_model(args.model)[0] if args.model else tiny_model(sizes)

    base = base_model()
    # parameters() lists a tied embedding once (state_dict would count it twice)
    base_mb = sum(t.numel() * t.element_size() for t in base.parameters()) / 2**20
    torch.manual_seed(0)  # LoRA's A: the same adapter in both processes
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero (a no-op adapter): give it weights
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    reference = adapters_off(model) if args.reference == "adapters-off" else base_model()
    ids = random_ids(sizes.calib_texts, sizes.text_len, vocab_size(model), seed=5)
    with torch.no_grad():  # every weight resident (safetensors load lazily) before the peak
        warm = ids[: sizes.calib_batch]
        for m in (model, reference):
            forward_logits(m, warm, torch.ones_like(warm))
    models_mb = peak_rss_mb()
    start = time.perf_counter()
    artifact = calibrate(
        model,
        reference,
        ids,
        "gss",
        layer=len(find_decoder_blocks(model)) // 2,
        rank=sizes.calib_rank,
        batch_size=sizes.calib_batch,
        progress=False,
    )
    seconds = time.perf_counter() - start
    record = {
        "reference": args.reference,
        "base_weights_mb": base_mb,
        "peak_rss_models_mb": models_mb,
        "peak_rss_mb": peak_rss_mb(),
        "calibrate_seconds": seconds,
        "tokens": int(ids.numel()),
        "memorized_share": artifact.provenance.token_counts["memorized_share"],
        "artifact_checksum": float(artifact.probe.double().abs().sum())
        + float(artifact.steer.double().abs().sum()),
    }
    print(json.dumps(record))
    return 0


def run(
    sizes: Sizes, *, model_path: str | None, quick: bool, threads: int | None, progress: bool
) -> dict[str, Any]:
    if importlib.util.find_spec("peft") is None:
        reason = "peft is not installed (pip install 'gated-subspace-steering[peft]')"
        log(f"adapters: skipped, {reason}")
        return {"skipped": reason}
    name = Path(model_path).name if model_path else "tiny-llama"
    rows = []
    for reference in REFERENCES:
        args = ["--reference", reference, *(["--model", model_path] if model_path else [])]
        record = run_child(
            "gss_bench.perf.adapters",
            args,
            quick=quick,
            threads=threads,
            what=f"adapters child ({reference})",
        )
        rows.append(record)
        log(
            f"adapters/{name}: reference {reference}: peak {record['peak_rss_mb']:.0f} MB, "
            f"calibrate {record['calibrate_seconds']:.2f} s"
        )
    loaded, off = rows
    checks = (loaded["artifact_checksum"], off["artifact_checksum"])
    return {
        "method": (
            "a seeded rank-8 LoRA on q_proj and v_proj (B drawn at std 0.02) over the model; "
            "gss.calibrate against the base loaded a second time vs gss.adapters_off(model), "
            "each in a fresh process; peak RSS (VmHWM) with both models resident (after one "
            "forward each) and after calibration; the artifact checksum (sum |probe| + sum "
            "|steer|) must agree"
        ),
        "model": name,
        "rows": rows,
        "saved_mb": loaded["peak_rss_mb"] - off["peak_rss_mb"],
        "same_artifact": abs(checks[0] - checks[1]) <= 1e-6 * max(1.0, abs(checks[0])),
        "time_ratio": off["calibrate_seconds"] / loaded["calibrate_seconds"],
    }


def table(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"Skipped: {result['skipped']}.\n"
    header = ["reference", "peak RSS, models resident MB", "peak RSS MB", "calibrate s"]
    rows = [
        [
            "base loaded again" if r["reference"] == "loaded" else "gss.adapters_off(model)",
            f"{r['peak_rss_models_mb']:.0f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['calibrate_seconds']:.2f}",
        ]
        for r in result["rows"]
    ]
    base_mb = result["rows"][0]["base_weights_mb"]
    same = "the same artifact" if result["same_artifact"] else "**different artifacts**"
    return markdown_table(header, rows) + (
        f"\n{result['model']}: adapters_off lowers the peak by {result['saved_mb']:.0f} MB (the "
        f"base's weights: {base_mb:.0f} MB), calibrate time {result['time_ratio']:.2f}x, "
        f"{same} (checksums {result['rows'][0]['artifact_checksum']:.6g} / "
        f"{result['rows'][1]['artifact_checksum']:.6g}).\n"
    )


if __name__ == "__main__":
    raise SystemExit(child())
