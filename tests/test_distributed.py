"""Calibration over 2 CPU processes (gloo) gives the artifact of one process on all the data."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gss

from .helpers import random_ids, tiny_model

KW = dict(layer=0, rank=3, batch_size=4, progress=False)
# Seconds the two ranks get. On torch 2.4.1 (never on CI's torch) gloo's teardown fails now and
# then after the artifact is written: destroy_process_group hung (py-spy: 6 of ~30 runs, with a
# file or a TCP store, with or without a barrier first), and without it the exit aborted (4 of
# 25). A hang must fail the test instead of stalling CI.
DEADLINE = 180


def _data(quantile: bool) -> tuple:
    """Token ids for the quantile rule's run; for the other, conversations through a chat
    template, so the replies' signal (gss.signal.replies) is summed over the ranks too."""
    if quantile:
        return random_ids(13, 12), {}
    from .helpers import word_tokenizer
    from .signal.test_replies import _conversations
    from .test_data import TEMPLATE

    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return _conversations(13), {"tokenizer": tokenizer}


def _extra(quantile: bool) -> dict:
    """The quantile rule's run also caps the threshold sample below the general tokens
    (the cap then binds over both ranks' rows together)."""
    return {"memorized_quantile": 0.3, "max_threshold_samples": 20} if quantile else {}


def _worker(rank: int, init_file: str, out: str, quantile: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model, ref = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
        texts, tokenizer = _data(quantile)
        art = gss.calibrate(model, ref, texts, **KW, **_extra(quantile), **tokenizer)
        if rank == 0:
            art.save_pretrained(out)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, quantile: bool):
    out = tmp_path / f"dist-{quantile}"
    args = (str(tmp_path / f"init-{quantile}"), str(out), quantile)
    ranks = mp.spawn(_worker, args=args, nprocs=2, join=False)
    started = time.monotonic()
    while not ranks.join(timeout=5):
        if time.monotonic() - started > DEADLINE:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish in {DEADLINE} s")
    model, ref = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    texts, tokenizer = _data(quantile)
    single = gss.calibrate(model, ref, texts, **KW, **_extra(quantile), **tokenizer)
    return gss.load(out), single


@pytest.mark.heavy
def test_two_ranks_equal_one_process(tmp_path):
    for quantile in (False, True):
        multi, single = _run(tmp_path, quantile)
        counts = multi.provenance.token_counts, single.provenance.token_counts
        # a capped sample: as many responses as one process keeps, another random subset of
        # them (so other thresholds); below the cap, the same responses
        assert counts[0]["threshold_samples"] == counts[1]["threshold_samples"]
        assert counts[0]["threshold_samples"] == (20 if quantile else counts[1]["general"])
        for name in ("probe", "steer", "singular_values", *(() if quantile else ("thresholds",))):
            assert torch.allclose(
                getattr(multi, name).double(), getattr(single, name).double(), rtol=1e-4, atol=1e-5
            ), name
        for key in ("tokens", "memorized", "general", "sequences"):
            assert multi.provenance.token_counts[key] == single.provenance.token_counts[key]
        if not quantile:
            replies = multi.provenance.token_counts["replies"]
            assert replies["rows"] == 13 and replies["reply_tokens"] == 13 * 7
            assert replies == pytest.approx(single.provenance.token_counts["replies"], rel=1e-5)
