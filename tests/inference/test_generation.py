"""gss.inference.generation: the greedy text `gss generate` prints, from the library.

`generate_steered` gives the texts, the gate line and the evidence the command prints (the
command only reads its flags, loads and prints); the steered text is the one the steer attached
as `attach` attaches it gives, the recorded one (``explain``) the same tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gss.cli import main
from gss.errors import GSSError
from gss.inference.generation import encode_prompt, generate_steered

from ..helpers import calibrated_llama, word_tokenizer

PROMPTS = ["w1 w2 w3", "w9 w8"]


@pytest.fixture(scope="module")
def steered():
    model, art = calibrated_llama()
    return model.eval(), art, word_tokenizer()


def test_the_library_gives_what_gss_generate_prints(steered, tmp_path, capsys):
    model, art, tokenizer = steered
    copy.deepcopy(model).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    art.save_pretrained(tmp_path / "artifact")
    args = ["generate", "--model", str(tmp_path / "model"), "--steer", str(tmp_path / "artifact")]
    args += [a for p in PROMPTS for a in ("--prompt", p)]
    assert main([*args, "--max-new-tokens", "6", "--compare"]) == 0
    printed = capsys.readouterr().out.splitlines()
    result = generate_steered(model, tokenizer, art, PROMPTS, max_new_tokens=6, compare=True)
    assert result.unsteered is not None
    expected = []
    for prompt, steered_text, unsteered in zip(
        PROMPTS, result.steered, result.unsteered, strict=True
    ):
        expected += [f"prompt:    {prompt}", f"steered:   {steered_text}"]
        expected += [f"unsteered: {unsteered}"]
    assert printed == [*expected, result.summary()]
    assert result.summary().startswith("(gate opened on ")
    assert (
        result.steered != result.unsteered
    )  # the steer changes the text: the check means something


def test_explain_records_the_same_tokens_and_writes_a_row_per_token(steered, tmp_path):
    model, art, tokenizer = steered
    plain = generate_steered(model, tokenizer, art, PROMPTS, max_new_tokens=5)
    explained = generate_steered(model, tokenizer, art, PROMPTS, max_new_tokens=5, explain=True)
    assert explained.steered == plain.steered and explained.summary() == plain.summary()
    assert len(explained.explanations) == 2 and plain.explanations == []
    out = tmp_path / "rows" / "explain.jsonl"
    assert explained.write_explanations(out) == (3 + 5) + (2 + 5)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_index"] for r in rows] == [0] * 8 + [1] * 7
    assert {r["prompt"] for r in rows} == set(PROMPTS)


def test_a_prompt_past_the_context_and_bad_hand_over_options_are_refused(steered):
    model, art, tokenizer = steered
    with pytest.raises(GSSError, match="pass the model's context"):
        encode_prompt("w1 w2", tokenizer, model, max_new_tokens=10_000)
    with pytest.raises(GSSError, match="--explain records the steer alone"):
        generate_steered(model, tokenizer, art, PROMPTS, explain=True, reference=model)
    with pytest.raises(GSSError, match="handoff_gates must be 'steer', 'none' or None"):
        generate_steered(model, tokenizer, art, PROMPTS, reference=model, handoff_gates="both")
    enc = encode_prompt("w1 w2", tokenizer, model, max_new_tokens=4)
    assert torch.equal(enc["input_ids"], tokenizer("w1 w2", return_tensors="pt")["input_ids"])
