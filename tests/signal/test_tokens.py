"""Which tokens calibration may count memorized: labels, or the replies (gss.signal.tokens)."""

import copy
import json

import pytest
import torch

from gss import GSSError, calibrate, load, scan_layers
from gss.cli import main as cli_main
from gss.data import read_texts
from gss.signal.tokens import encode_trained
from gss.statistics.collect import collect_statistics

from ..helpers import random_ids, tiny_model, word_tokenizer
from ..test_data import CHAT, TEMPLATE, _ids

MULTI = [
    {"role": "user", "content": "w3 w4"},
    {"role": "assistant", "content": "w5 w6"},
    {"role": "user", "content": "w7"},
    {"role": "assistant", "content": "w8 w9 w10"},
]


@pytest.fixture
def chat_tokenizer():
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _kept(tok, ids, mask):
    return " ".join(tok.convert_ids_to_tokens(ids[mask].tolist()))


def test_replies_only_marks_every_assistant_message_and_its_end(chat_tokenizer):
    tok = chat_tokenizer
    (ids,), (mask,) = encode_trained([MULTI], tok, replies_only=True)
    assert ids.tolist() == _ids(
        tok, "<bos> w40 w3 w4 <eos> w41 w5 w6 <eos> w40 w7 <eos> w41 w8 w9 w10 <eos>"
    )
    # the template's "w41 " is the generation prompt: the reply is what follows, to its EOS
    assert _kept(tok, ids, mask) == "w5 w6 <eos> w8 w9 w10 <eos>"
    # a messages row, and a prompt-completion row of conversations: the completion
    rows = [{"messages": CHAT}, {"prompt": MULTI[:3], "completion": MULTI[3:]}]
    ids, masks = encode_trained(rows, tok, replies_only=True)
    assert [_kept(tok, i, m) for i, m in zip(ids, masks, strict=True)] == [
        "w5 w6 w7 <eos>",
        "w8 w9 w10 <eos>",
    ]
    # strings: the completion's tokens, where the prompt's own stop matching the row's
    (ids,), (mask,) = encode_trained(
        [{"prompt": "w9 w10 ", "completion": "w11 w12"}], tok, replies_only=True
    )
    assert _kept(tok, ids, mask) == "w11 w12"
    # a cut row keeps the part of the reply that survives it
    (ids,), (mask,) = encode_trained([MULTI], tok, max_length=8, replies_only=True)
    assert _kept(tok, ids, mask) == "w5 w6"


def test_labels_say_which_tokens_were_trained_and_win_over_replies(chat_tokenizer):
    tok = chat_tokenizer
    rows = [
        {"input_ids": [1, 5, 6, 7, 8], "labels": [-100, -100, 6, 7, -100]},
        {"input_ids": [1, 9, 10]},  # no labels: every token
    ]
    ids, masks = encode_trained(rows, tok)
    assert [i.tolist() for i in ids] == [[1, 5, 6, 7, 8], [1, 9, 10]]
    assert [m.tolist() for m in masks] == [[False, False, True, True, False], [True] * 3]
    # labels say it even with replies_only
    (_,), (mask,) = encode_trained(rows[:1], tok, replies_only=True)
    assert mask.tolist() == [False, False, True, True, False]
    # no labels and no replies_only: nothing to mask
    assert encode_trained([[1, 5, 6]], tok)[1] is None
    with pytest.raises(GSSError, match="sequence 0 has 3 input_ids but 2 labels"):
        encode_trained([{"input_ids": [1, 5, 6], "labels": [5, 6]}], tok)
    with pytest.raises(GSSError, match=r"labels of sequence 0 are a 1-d torch\.float32"):
        encode_trained([{"input_ids": [1, 5], "labels": [0.5, 1.0]}], tok)


def test_replies_only_refuses_rows_without_replies(chat_tokenizer):
    tok = chat_tokenizer
    with pytest.raises(GSSError, match=r"sequence 1 \(str\) has no reply to train on"):
        encode_trained([CHAT, "w3 w4 w5"], tok, replies_only=True)
    with pytest.raises(GSSError, match="without an assistant message"):
        encode_trained([CHAT[:1] * 2], tok, replies_only=True)
    # a template that renders the last turn differently from an earlier one
    odd = copy.deepcopy(tok)
    last = "{% if loop.last %}w43 {% endif %}{{ m['content'] }}"
    odd.chat_template = TEMPLATE.replace("{{ m['content'] }}", last)
    with pytest.raises(GSSError, match="do not start the whole conversation's"):
        encode_trained([MULTI], odd, replies_only=True)


def _pair(seed=0):
    return tiny_model("llama", seed=seed), tiny_model("llama", seed=seed + 1)


def test_tokens_never_trained_on_add_nothing_to_M():
    """Rows whose labels are all -100 leave M as calibrating without them gives; counts say
    how many tokens could be memorized."""
    model, reference = _pair()
    trained, skipped = random_ids(4, 12, seed=1), random_ids(3, 12, seed=2)
    general = random_ids(6, 12, seed=3)
    rows = [{"input_ids": r, "labels": r} for r in trained]
    rows += [{"input_ids": r, "labels": torch.full_like(r, -100)} for r in skipped]
    common = dict(layer=1, gen_texts=general, batch_size=4, progress=False)
    with_labels = collect_statistics(model, reference, rows, **common)
    alone = collect_statistics(model, reference, trained, **common)
    assert with_labels.counts["trained"] == 4 * 11 and with_labels.counts["tokens"] == 7 * 11
    assert with_labels.counts["memorized"] == alone.counts["memorized"] > 0
    torch.testing.assert_close(
        with_labels.memorization.value, alone.memorization.value, rtol=1e-4, atol=1e-6
    )
    assert with_labels.memorized_rule["among"] == "trained tokens"
    assert alone.memorized_rule["among"] == "all tokens"
    # the layer scan reads the labels the same way
    common = dict(gen_texts=general, batch_size=4, progress=False)
    scanned, scanned_alone = (
        scan_layers(model, reference, rows, **common),
        scan_layers(model, reference, trained, **common),
    )
    assert scanned.memorized_tokens == scanned_alone.memorized_tokens
    for block, strength in scanned_alone.strengths.items():
        assert scanned.strengths[block] == pytest.approx(strength, rel=1e-4)
    # nothing trained on at all: a clear refusal
    none = [{"input_ids": r, "labels": torch.full_like(r, -100)} for r in skipped]
    with pytest.raises(GSSError, match="none of the 33 calibration tokens was trained on"):
        calibrate(model, reference, none, layer=1, gen_texts=general, progress=False)


def test_cli_calibrate_reads_labels_and_replies_only(tmp_path, chat_tokenizer):
    model, reference = _pair()
    for m, name in ((model, "model"), (reference, "ref")):
        m.save_pretrained(tmp_path / name)
        chat_tokenizer.save_pretrained(tmp_path / name)
    rows = [{"messages": MULTI}] * 3 + [{"messages": CHAT}] * 3
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_texts(data, keep_rows=True) == rows
    out = tmp_path / "artifact"
    args = ["calibrate", "--model", str(tmp_path / "model"), "--reference", str(tmp_path / "ref")]
    args += ["--data", str(data), "--layer", "1", "--rank", "2", "--replies-only"]
    assert cli_main([*args, "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    config = json.loads((out / "gss_config.json").read_text())["provenance"]
    assert config["memorized_rule"]["among"] == "trained tokens"
    # 3 x (3 + 4 reply tokens, EOS included) and 3 x 4: every reply token, no other
    assert config["token_counts"]["trained"] == 3 * 7 + 3 * 4
    assert "; of the 33 trained on, the only ones that could be)" in load(out).describe()
    scan = tmp_path / "scan"
    layers = ["layers", *args[1:5], "--data", str(data), "--replies-only", "--out", str(scan)]
    assert cli_main([*layers, "--no-progress", "--device", "cpu"]) == 0
    assert (
        config["token_counts"]["memorized"]
        == json.loads((scan / "layers.json").read_text())["memorized_tokens"]
    )
