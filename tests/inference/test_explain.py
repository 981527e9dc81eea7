"""gss.explain and gss generate --explain: per-token evidence of a steered generation.

Recording never changes what is generated (the same token ids as the steer attached without
recording, and as `gss generate` counts its gates), works with the KV cache (the prompt in one
pass, then one position per decode step, each matched to its token: the responses equal those
of one cache-free pass over the whole sequence), and says what the steer did: a position whose
gates all stayed closed is unchanged, one open direction moves the hidden state by |s_k|.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

import gss
from gss.cli import main
from gss.inference.explain import Explanation

from ..helpers import calibrated_llama, random_ids, tiny_model, word_tokenizer

NEW = 10


@pytest.fixture(scope="module")
def steered():
    return calibrated_llama()


def _plain(model, art, prompt, *, device="cpu", tracked=(False, True), **options):
    """Greedy ids with the steer attached as gss generate attaches it, and without tracking."""
    ids = torch.tensor([prompt], device=device)
    runs = []
    for track in tracked:
        with art.attach(model, track_gates=track, **options), torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
        runs.append(out[0, ids.shape[1] :].tolist())
    assert all(run == runs[0] for run in runs)
    return runs[0]


OPTIONS = [
    {},  # hard gate, projection: the fused steer
    {"gate": "relu"},  # the checked path
    {"gate": "none", "delta": 4.0},
    {"coefficient": "ridge", "rank": 1},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(map(str, o.values())) or "own")
def test_recording_changes_no_token(steered, options):
    model, art = steered
    for seed in (5, 6):
        prompt = random_ids(1, 7, seed=seed)[0].tolist()
        expected = _plain(model, art, prompt, **options)
        e = gss.explain(model, art, prompt, max_new_tokens=NEW, pad_token_id=0, **options)
        assert list(e.generated_ids) == expected
        assert list(e.prompt_ids) == prompt


def test_a_model_left_in_training_mode_is_explained_without_dropout(make_model):
    model = make_model("gpt2")  # dropout 0.1
    art = gss.calibrate(
        model, make_model("gpt2", seed=1), random_ids(12, 10), layer=0, progress=False
    )
    prompt = random_ids(1, 5, seed=5)[0].tolist()
    expected = gss.explain(model.eval(), art, prompt, max_new_tokens=NEW, pad_token_id=0)
    model.train()
    for _ in range(2):
        e = gss.explain(model, art, prompt, max_new_tokens=NEW, pad_token_id=0)
        assert e.generated_ids == expected.generated_ids
    assert model.training


def test_unsteered_tokens_differ_so_the_check_means_something(steered):
    model, art = steered
    prompt = random_ids(1, 7, seed=5)[0].tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        plain = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    e = gss.explain(model, art, prompt, max_new_tokens=NEW, pad_token_id=0)
    assert plain[0, 7:].tolist() != list(e.generated_ids)
    assert e.steered_tokens()  # some generated token was chosen where a gate opened


def test_positions_match_one_pass_over_the_whole_sequence(steered):
    """With the KV cache the prefill reads the prompt and each decode step one position; the
    steer at block L leaves block L's own input alone, so the responses recorded step by step
    are those of the unsteered model's block-L output over the whole sequence at once."""
    model, art = steered
    prompt = random_ids(1, 6, seed=8)[0].tolist()
    e = gss.explain(model, art, torch.tensor([prompt]), max_new_tokens=NEW, pad_token_id=0)
    everything = [*prompt, *e.generated_ids]
    assert len(e.tokens) == len(everything) == 6 + NEW
    assert [t.token_id for t in e.tokens] == everything
    assert [t.generated for t in e.tokens] == [False] * 6 + [True] * NEW
    assert [t.read for t in e.tokens] == [True] * (len(everything) - 1) + [False]
    assert e.tokens[-1].blocks == () and e.tokens[-1].next_token_id is None
    assert all(t.next_token_id == everything[t.position + 1] for t in e.tokens[:-1])

    block = gss.find_decoder_blocks(model)[art.layer]
    seen = []
    hook = block.register_forward_hook(
        lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            model(torch.tensor([everything[:-1]]))
    finally:
        hook.remove()
    hidden = seen[0][0].float()
    expected = hidden @ art.probe.T - art.offset
    recorded = torch.tensor([t.blocks[0].responses for t in e.tokens[:-1]])
    torch.testing.assert_close(recorded, expected, rtol=1e-4, atol=1e-4)
    norms = torch.tensor([t.blocks[0].hidden_norm for t in e.tokens[:-1]])
    torch.testing.assert_close(norms, hidden.norm(dim=-1), rtol=1e-4, atol=1e-4)


def test_the_evidence_says_what_the_steer_did(steered):
    model, art = steered
    prompt = random_ids(1, 8, seed=9)[0].tolist()
    e = gss.explain(model, art, prompt, max_new_tokens=NEW, pad_token_id=0)
    eps = art.thresholds.tolist()
    opened_somewhere = closed_somewhere = False
    for t in e.tokens:
        if not t.read:
            continue
        (b,) = t.blocks
        assert b.layer == art.layer and list(b.thresholds) == pytest.approx(eps)
        # the hard gate: open where |s_k| passes eps_k (at the steer's own rounding)
        for k, s in enumerate(b.responses):
            if abs(abs(s) - eps[k]) > 1e-4 * eps[k]:
                assert (k in b.opened) == (abs(s) > eps[k]), (t.position, k)
        if not b.opened:
            closed_somewhere = True
            assert b.change == 0.0 and b.relative_change == 0.0 and not t.steered
        else:
            opened_somewhere = True
            assert t.steered and b.change > 0
            if len(b.opened) == 1:  # projection coefficient: s_k times a unit vector
                assert b.change == pytest.approx(abs(b.responses[b.opened[0]]), rel=1e-3)
            assert b.relative_change == pytest.approx(b.change / b.hidden_norm)
    assert opened_somewhere and closed_somewhere
    # the same counts a tracked handle keeps
    ids = torch.tensor([prompt])
    with art.attach(model, track_gates=True) as handle, torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        counted = handle.gate_stats()
    stats = e.gate_stats()
    assert stats["tokens"] == counted["tokens"] == len(prompt) + NEW - 1
    assert stats["any_open_share"] == pytest.approx(counted["any_open_share"])


def test_rows_json_and_rendering(steered):
    model, art = steered
    tok = word_tokenizer()
    e = gss.explain(model, art, "w1 w2 w3 w4", max_new_tokens=6, tokenizer=tok)
    assert isinstance(e, Explanation)
    assert e.text == tok.decode(list(e.generated_ids), skip_special_tokens=True)
    rows = e.rows()
    assert len(rows) == len(e.prompt_ids) + len(e.generated_ids)
    json.loads(json.dumps(e.to_dict(), allow_nan=False))  # strict JSON, no NaN or Infinity
    first = rows[0]
    assert {"position", "token_id", "token", "source", "next_token", "read", "steered"} <= set(
        first
    )
    assert set(first["blocks"][0]) >= {"responses", "opened", "change", "relative_change"}
    assert [r["token"] for r in rows[:4]] == ["w1", " w2", " w3", " w4"]
    shown = e.render()
    assert str(e) == shown
    body = shown.splitlines()[0]
    assert body.startswith("explained: ")
    for t in e.steered_tokens():  # a token chosen where a gate opened is in brackets
        assert f"[{t.token.strip()}]" in body
    assert "(the last token: never read)" in shown
    assert len(shown.splitlines()) == len(rows) + 5  # three header lines, the table, the key


def test_infinite_thresholds_never_open_and_stay_strict_json(steered):
    model, art = steered
    closed = dataclasses.replace(art, thresholds=torch.full_like(art.thresholds, float("inf")))
    e = gss.explain(model, closed, [5, 6, 7], max_new_tokens=4, pad_token_id=0)
    assert not any(t.steered for t in e.tokens) and e.gate_stats()["any_open_share"] == 0.0
    assert json.loads(json.dumps(e.to_dict(), allow_nan=False))["steers"][0]["thresholds"] == [
        "inf",
        "inf",
    ]


def test_bad_input_is_refused(steered):
    model, art = steered
    with pytest.raises(gss.GSSError, match="one prompt"):
        gss.explain(model, art, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(gss.GSSError, match="needs tokenizer"):
        gss.explain(model, art, "w1 w2")
    with pytest.raises(gss.GSSError, match="no tokens"):
        gss.explain(model, art, [])
    with pytest.raises(gss.GSSError, match="max_new_tokens"):
        gss.explain(model, art, [3, 4], max_new_tokens=0)
    with pytest.raises(gss.GSSError, match="outside the model's vocabulary"):
        gss.explain(model, art, [3, 400])
    with pytest.raises(gss.GSSError, match="another model"):
        gss.explain(tiny_model("llama", seed=99), art, [3, 4])
    with pytest.raises(gss.GSSError, match=r"the prompt is a 1-d torch\.float32 array"):
        gss.explain(model, art, torch.tensor([3.0, 4.0]))
    with pytest.raises(gss.GSSError, match=r"the prompt holds a list \(\[3, 4\]\)"):
        gss.explain(model, art, [[3, 4]])
    as_array = gss.explain(model, art, np.array([3, 4]), max_new_tokens=2)
    assert as_array.generated_ids == gss.explain(model, art, [3, 4], max_new_tokens=2).generated_ids
    block = gss.find_decoder_blocks(model)[art.layer]
    assert "forward" not in block.__dict__  # nothing left attached after a refusal


def test_a_stack_is_explained_block_by_block(steered):
    stack_module = pytest.importorskip("gss.artifact.stack")
    model, art = steered
    ref = tiny_model("llama", seed=11)
    first = gss.calibrate(model, ref, random_ids(16, 14, seed=2), layer=0, rank=1, progress=False)
    stack = stack_module.SteeringStack((first.with_options(delta=25.0), art))
    prompt = random_ids(1, 7, seed=5)[0].tolist()
    ids = torch.tensor([prompt])
    with stack.attach(model, track_gates=True) as handle, torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        counted = handle.gate_stats()
    e = gss.explain(model, stack, prompt, max_new_tokens=NEW, pad_token_id=0)
    assert list(e.generated_ids) == out[0, 7:].tolist()
    assert [s["layer"] for s in e.steers] == [0, art.layer]
    assert all(len(t.blocks) == 2 for t in e.tokens[:-1])
    assert e.gate_stats()["any_open_share"] == pytest.approx(counted["any_open_share"])
    assert "b0:" in e.render()
    with pytest.raises(gss.GSSError, match="takes no options"):
        gss.explain(model, stack, prompt, delta=2.0)


# --- gss generate --explain / --explain-out ---


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory, steered):
    root = tmp_path_factory.mktemp("explain")
    model, art = steered
    copy.deepcopy(model).save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    art.save_pretrained(root / "artifact")
    return root


def test_generate_explain_prints_the_same_text_and_writes_one_row_per_token(cli_model, capsys):
    args = ["generate", "--model", str(cli_model / "model"), "--steer", str(cli_model / "artifact")]
    args += ["--prompt", "w1 w2 w3", "--prompt", "w9 w8", "--max-new-tokens", "6"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    out = cli_model / "rows" / "explain.jsonl"
    assert main([*args, "--explain", "--explain-out", str(out)]) == 0
    explained = capsys.readouterr().out
    # the steered texts and the gate line are the plain run's, the explanation comes between
    kept = [line for line in explained.splitlines() if line.startswith(("prompt:", "steered:"))]
    assert kept == [line for line in plain.splitlines() if line.startswith(("prompt:", "steered:"))]
    gate_line = [line for line in plain.splitlines() if line.startswith("(gate opened")]
    assert gate_line and gate_line[0] in explained
    assert explained.count("explained: ") == 2 and "|dh|/|h|" in explained
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_index"] for r in rows].count(0) == 3 + 6  # 3 words, 6 new
    assert {r["prompt"] for r in rows} == {"w1 w2 w3", "w9 w8"}
    assert f"wrote {out}" in explained
    # an existing file is refused before the model loads (the model path does not exist)
    missing = ["generate", "--model", str(cli_model / "nowhere"), "--steer", "x", "--prompt", "w1"]
    assert main([*missing, "--explain-out", str(out)]) == 2
    assert "already holds explain.jsonl: pass --overwrite" in capsys.readouterr().err
    assert main([*missing, "--explain-out", str(cli_model)]) == 2
    assert "is a directory" in capsys.readouterr().err
    # never into a model's folder, nor over a file gss did not write, nor --overwrite alone
    into_model = str(cli_model / "model" / "config.json")
    assert main([*missing, "--explain-out", into_model, "--overwrite"]) == 2
    assert "holds a model: results go into a directory of their own" in capsys.readouterr().err
    (cli_model / "rows" / "notes.jsonl").write_text("mine\n")
    notes = str(cli_model / "rows" / "notes.jsonl")
    assert main([*missing, "--explain-out", notes, "--overwrite"]) == 2
    assert "notes.jsonl was not written by gss" in capsys.readouterr().err
    assert main([*missing, "--overwrite"]) == 2
    assert "--overwrite replaces an existing --explain-out" in capsys.readouterr().err
    # --explain-out alone: written, nothing extra printed; --overwrite replaces it
    assert (
        main([*args[:-2], "--max-new-tokens", "2", "--explain-out", str(out), "--overwrite"]) == 0
    )
    printed = capsys.readouterr().out
    assert "explained:" not in printed
    assert len(out.read_text().splitlines()) == (3 + 2) + (2 + 2)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (benchmarks/scripts/gpu_checks.sh)"
)
def test_explain_on_cuda(steered):
    """On a GPU, explain records the generation the steer gives there, position by position."""
    model, art = steered[0], steered[1]
    gpu = copy.deepcopy(model).cuda()
    prompt = random_ids(1, 6, seed=4)[0].tolist()
    got = gss.explain(gpu, art, prompt, max_new_tokens=NEW)
    want = gss.explain(model, art, prompt, max_new_tokens=NEW)
    assert list(got.generated_ids) == _plain(gpu, art, prompt, device="cuda", tracked=(False,))
    assert len(got.tokens) == len(want.tokens)
    for a, b in zip(got.tokens[: len(prompt)], want.tokens[: len(prompt)], strict=True):
        assert a.blocks[0].responses == pytest.approx(b.blocks[0].responses, abs=1e-3)
