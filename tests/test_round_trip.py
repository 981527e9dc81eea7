"""Issue 41's round trip, end to end and offline: calibrate from a `datasets.Dataset`, push the
artifact (to a faked Hub whose upload lands in a local Hub cache, as a download would cache
it), then in a fresh process load the model and the artifact by repo id with
``HF_HUB_OFFLINE=1`` and steer: the outputs equal the local artifact's bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import gss

from .artifact.test_hub import MAIN, fake_hub, offline_cache, put_in_cache  # noqa: F401 (fixtures)
from .helpers import tiny_model, word_tokenizer

datasets = pytest.importorskip("datasets")

FRESH_PROCESS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
import gss
from gss.hf.loading import load_model

model, tokenizer = load_model("org/tiny-model")  # by repo id, from the offline cache
artifact = gss.load("org/tiny-steer")
ids = torch.tensor(json.loads(sys.argv[1]))
with torch.no_grad(), gss.steer(model, artifact):
    logits = model(input_ids=ids).logits
    out = model.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
torch.save({"logits": logits, "generated": out}, sys.argv[2])
"""


def test_dataset_to_hub_to_a_fresh_process_is_bit_identical(
    fake_hub,  # noqa: F811
    offline_cache,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    model_dir = tmp_path / "model"
    tiny_model("llama", seed=3).save_pretrained(model_dir)
    tokenizer = word_tokenizer()
    tokenizer.save_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reference = tiny_model("llama", seed=11)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(24)]
    dataset = datasets.Dataset.from_dict({"text": lines})

    options = {"tokenizer": tokenizer, "layer": 1, "rank": 2, "progress": False}
    artifact = gss.calibrate(model, reference, dataset, **options).with_options(delta=25.0)
    from_list = gss.calibrate(model, reference, lines, **options).with_options(delta=25.0)
    for name in ("probe", "steer", "thresholds"):
        assert torch.equal(getattr(artifact, name), getattr(from_list, name)), name
    local = artifact.save_pretrained(tmp_path / "local-artifact")

    artifact.push_to_hub("org/tiny-steer")
    put_in_cache(offline_cache, "org/tiny-steer", fake_hub.remote, MAIN)  # as a download would
    put_in_cache(offline_cache, "org/tiny-model", model_dir, MAIN)

    ids = tokenizer(lines[:2], return_tensors="pt").input_ids
    with torch.no_grad(), gss.steer(model, gss.load(local)):
        logits = model(input_ids=ids).logits
        generated = model.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        unsteered = model(input_ids=ids).logits
    assert not torch.equal(logits, unsteered)  # the steer acts on these rows

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(offline_cache)}
    out = tmp_path / "fresh.pt"
    subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, json.dumps(ids.tolist()), str(out)],
        env=env,
        check=True,
        cwd=tmp_path,  # not the checkout: no local folder named like the repo ids
    )
    fresh = torch.load(out)
    assert torch.equal(fresh["logits"], logits)
    assert torch.equal(fresh["generated"], generated)
