"""Where a decode step's steer spends its time on CUDA, and what a fused steer saves.

A developer's measurement script for the device machine (not part of ``gss bench``): checks
each variant of the fused hard-gated steer against a float64 reference, times one call at a
decode step's shape (batch x 1 x d, bf16), and times greedy ``generate`` eager and compiled
(static cache, transformers' own auto-compile), steered and unsteered, interleaved.
``--profile`` instead profiles a few greedy decode steps of each arm with torch.profiler: where
the host's time per step goes, how much of it the GPU is busy, and how many synchronizations
each step makes (does a step wait for the GPU, and does the steer add a wait?).

    PYTHONPATH=src python3 benchmarks/scripts/cuda_steer_variants.py [--out DIR] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from gss_bench.perf.common import Sizes, tiny_model
from gss_bench.perf.overhead import build_artifact

DEV = torch.device("cuda")


def timed_calls(fn, x, calls=2000, rounds=5):
    for _ in range(200):
        fn(x)
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(per)


def smollm2_shape(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    m = LlamaForCausalLM(cfg).to(device=DEV, dtype=dtype).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def variants(art, d, dtype):
    hook = art.make_hook()
    f = hook._params(DEV)
    probe_t, neg_off, neg_steer = f["fused_probe_t"], f["fused_neg_offset"], f["fused_neg_steer"]
    shrink = torch.nn.functional.hardshrink
    out = {}
    h0 = torch.randn(1, 1, d, device=DEV, dtype=dtype)
    hook(None, (), h0)  # builds the fused closure
    fast = hook._fast

    def closure(h):  # the fused steer alone: (steered, gated responses) -> steered
        return fast(h)[0]

    out["gss hook (current)"] = lambda h: hook(None, (), h)
    out["fused closure alone"] = closure
    pt16, no16, ns16 = (t.to(dtype) for t in (probe_t, neg_off, neg_steer))

    def native(h):  # no float casts: bf16 operands, fp32 accumulation inside cuBLAS
        x = h.view(-1, h.shape[-1])
        return torch.addmm(x, shrink(torch.addmm(no16, x, pt16), 1.0), ns16).view_as(h)

    out["bf16 ops, no casts (3 kernels)"] = native
    out["torch.compile(closure)"] = torch.compile(closure, dynamic=False)
    out["no-op python call"] = lambda h: h
    out["h.float() alone"] = lambda h: h.float()
    out["one addmm (fp32, K cols)"] = lambda h: torch.addmm(neg_off, h.view(-1, d).float(), probe_t)
    return out, (probe_t, neg_off, neg_steer)


def reference(h, params):
    probe_t, neg_off, neg_steer = (t.double() for t in params)
    x = h.reshape(-1, h.shape[-1]).double()
    s = torch.nn.functional.hardshrink(x @ probe_t + neg_off, 1.0)
    return (x + s @ neg_steer).view_as(h)


def hook_micro(name, model, dtype, rows):
    art = build_artifact(model, Sizes(), 16)
    d = model.config.hidden_size
    for k in (4, 16):
        a = art.with_options(rank=k)
        fns, params = variants(a, d, dtype)
        for batch in (1, 16):
            h = torch.randn(batch, 1, d, device=DEV, dtype=dtype) * 3
            ref = reference(h, params)
            for vname, fn in fns.items():
                err = None
                try:
                    if "alone" not in vname and "no-op" not in vname and "addmm" not in vname:
                        got = fn(h).double()
                        err = float((got - ref).norm() / ref.norm())
                    us = timed_calls(fn, h)
                except Exception as exc:
                    print(f"{name} K={k} b={batch} {vname}: FAILED {exc!r}"[:600], flush=True)
                    continue
                rows.append(dict(model=name, K=k, batch=batch, variant=vname, us=us, rel_err=err))
                print(f"{name} K={k} b={batch} {vname:34s} {us:8.1f} us  err {err}", flush=True)


def generate(model, ids, n, static):
    kw = dict(cache_implementation="static") if static else {}
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )


def generate_compare(name, model, rows, new_tokens=64, rounds=7):
    from gss.steering.compiled import compiled_parts

    torch._dynamo.config.skip_nnmodule_hook_guards = False  # attach/detach recompiles
    art = build_artifact(model, Sizes(), 4)
    vocab = model.config.vocab_size
    for batch in (1, 16):
        ids = torch.randint(3, vocab, (batch, 16), device=DEV)

        def run(steer, static, ids=ids):
            if steer:
                with art.attach(model):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    toks = generate(model, ids, new_tokens, static)
                    torch.cuda.synchronize()
            else:
                torch.cuda.synchronize()
                t = time.perf_counter()
                toks = generate(model, ids, new_tokens, static)
                torch.cuda.synchronize()
            return time.perf_counter() - t, toks

        arms = {(s, c): [] for s in (False, True) for c in (False, True)}
        toks = {}
        t0 = time.perf_counter()
        for arm in arms:  # warm-up: compiles both static variants
            for _ in range(3):
                _, toks[arm] = run(*arm)
        print(
            f"{name} b={batch}: warm-up {time.perf_counter() - t0:.1f} s; compiled parts: "
            f"{compiled_parts(model)}",
            flush=True,
        )
        for r in range(rounds):
            order = list(arms)
            order = order[r % 4 :] + order[: r % 4]
            for arm in order:
                arms[arm].append(run(*arm)[0])
        eager = statistics.median(arms[False, False])
        comp = statistics.median(arms[False, True])
        res = dict(
            model=name,
            batch=batch,
            new_tokens=new_tokens,
            eager_tok_s=batch * new_tokens / eager,
            compiled_tok_s=batch * new_tokens / comp,
            eager_ratio=statistics.median(
                u / s for u, s in zip(arms[False, False], arms[True, False], strict=True)
            ),
            compiled_ratio=statistics.median(
                u / s for u, s in zip(arms[False, True], arms[True, True], strict=True)
            ),
            same_tokens_steered=bool(torch.equal(toks[True, False], toks[True, True])),
            same_tokens_unsteered=bool(torch.equal(toks[False, False], toks[False, True])),
            steer_changes_tokens=not bool(torch.equal(toks[False, False], toks[True, False])),
        )
        rows.append(res)
        print(json.dumps(res), flush=True)


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def profile_decode(name, model, out, new_tokens=16):
    """torch.profiler over one greedy generate per arm (eager and compiled static cache,
    steered and unsteered, batch 1, after warm-up): host time per token, GPU kernel time per
    token, the host-side sync and copy calls, and the top ops by host time (tables per arm)."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.config.skip_nnmodule_hook_guards = False
    art = build_artifact(model, Sizes(), 4)
    ids = torch.randint(3, model.config.vocab_size, (1, 16), device=DEV)
    summary = []
    for static in (False, True):
        for steer in (False, True):
            tag = f"{name}-{'compiled' if static else 'eager'}-{'gss' if steer else 'unsteered'}"
            with art.attach(model) if steer else nullcontext():
                for _ in range(3):
                    generate(model, ids, new_tokens, static)
                torch.cuda.synchronize()
                t = time.perf_counter()
                generate(model, ids, new_tokens, static)
                torch.cuda.synchronize()
                plain = time.perf_counter() - t
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    t = time.perf_counter()
                    generate(model, ids, new_tokens, static)
                    torch.cuda.synchronize()
                    profiled = time.perf_counter() - t
            events = prof.key_averages()
            device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
            row = dict(
                arm=tag,
                ms_per_token=plain / new_tokens * 1e3,
                ms_per_token_profiled=profiled / new_tokens * 1e3,
                gpu_busy_ms_per_token=device_us / new_tokens / 1e3,
                sync_calls_per_token={
                    e.key: e.count / new_tokens for e in events if e.key in SYNC_EVENTS
                },
                addmm_calls_per_token=sum(e.count for e in events if e.key == "aten::addmm")
                / new_tokens,
            )
            summary.append(row)
            print(json.dumps(row), flush=True)
            table = events.table(sort_by="self_cpu_time_total", row_limit=30)
            Path(out, f"profile-{tag}.txt").write_text(table)
    return summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--skip-micro", action="store_true", help="only the generate comparison")
    p.add_argument("--profile", action="store_true", help="profile decode steps instead")
    args = p.parse_args()
    dtype = torch.bfloat16
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.profile:
        rows = profile_decode("smollm2-135m-shape", smollm2_shape(dtype), args.out)
        Path(args.out, "profile.json").write_text(json.dumps(rows, indent=1))
        return 0
    micro, gen = [], []
    models = {
        "tiny-llama": tiny_model(Sizes(), device=DEV, dtype=dtype),
        "smollm2-135m-shape": smollm2_shape(dtype),
    }
    for name, m in models.items():
        if not args.skip_micro:
            hook_micro(name, m, dtype, micro)
    if not args.skip_generate:
        for name, m in models.items():
            try:
                generate_compare(name, m, gen)
            except Exception as err:
                import traceback

                traceback.print_exc()
                gen.append(dict(model=name, error=repr(err)))
    Path(args.out, "variants.json").write_text(
        json.dumps(dict(micro=micro, generate=gen), indent=1)
    )
    print(json.dumps(gen, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
