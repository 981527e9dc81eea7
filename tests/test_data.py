"""What gss accepts as calibration and evaluation data: texts, conversations (through the chat
template), dataset rows in the usual fine-tuning formats, token ids; and what it refuses, before
any model runs."""

import json

import numpy as np
import pytest
import torch

import gss
from gss import GSSError
from gss.data import chat_prompt, encode, encode_compact, encode_replies, read_texts
from gss.evaluate import evaluate_model

from .helpers import random_ids, word_tokenizer

# roles as words of the test vocabulary: w40 opens a user turn, w41 an assistant turn
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}w40 {% else %}w41 "
    "{% endif %}{{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}w41 {% endif %}"
)
CHAT = [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _ids(tok, words):
    return tok.convert_tokens_to_ids(words.split())


def test_a_conversation_is_the_token_ids_its_chat_template_gives(chat_tokenizer):
    tok = chat_tokenizer
    # the template holds the one BOS: none is added in front of it
    want = _ids(tok, "<bos> w40 w3 w4 <eos> w41 w5 w6 w7 <eos>")
    assert encode([CHAT], tok) == [want]
    templated = tok.apply_chat_template(CHAT, tokenize=True)  # a dict in transformers 5
    assert want == (templated if isinstance(templated, list) else list(templated["input_ids"]))
    assert [t.tolist() for t in encode_compact([CHAT], tok)] == [want]
    # a plain string still gets the tokenizer's own special tokens, in its place in the list
    plain = tok("w9 w10")["input_ids"]
    assert encode(["w9 w10", CHAT], tok) == [plain, want]


def test_dataset_rows_in_the_usual_fine_tuning_formats(chat_tokenizer):
    tok = chat_tokenizer
    chat = _ids(tok, "<bos> w40 w3 w4 <eos> w41 w5 w6 w7 <eos>")
    rows = [
        {"text": "w9 w10 w11", "id": 3},  # other keys are ignored
        {"messages": CHAT},
        {"prompt": "w9 ", "completion": "w10 w11"},  # strings: joined as they are
        {"prompt": CHAT[:1], "completion": CHAT[1:]},  # conversations: one conversation
    ]
    text = tok("w9 w10 w11")["input_ids"]
    assert encode(rows, tok) == [text, chat, text, chat]


def test_replies_are_split_from_what_prompts_them(chat_tokenizer):
    tok = chat_tokenizer
    prompt = _ids(tok, "<bos> w40 w3 w4 <eos> w41")  # the template up to the assistant's turn
    reply = _ids(tok, "w5 w6 w7 <eos>")
    assert prompt == list(tok(chat_prompt("w3 w4", tok), add_special_tokens=False)["input_ids"])
    pairs = encode_replies(
        [CHAT, {"messages": CHAT}, {"prompt": CHAT[:1], "completion": CHAT[1:]}], tok
    )
    assert pairs == [(prompt, reply)] * 3
    assert encode_replies([CHAT], tok, max_reply=2) == [(prompt, reply[:2])]
    # strings: the whole row tokenized, split where the prompt alone stops matching it
    ((p, r),) = encode_replies([{"prompt": "w9 w10", "completion": " w11 w12"}], tok)
    assert p + r == tok("w9 w10 w11 w12")["input_ids"] and r[-2:] == _ids(tok, "w11 w12")
    assert p == tok("w9 w10")["input_ids"]
    with pytest.raises(GSSError, match="ending with a 'user' message"):
        encode_replies([CHAT[:1]], tok)
    with pytest.raises(GSSError, match=r"sequence 1 .* has no reply to separate"):
        encode_replies([CHAT, {"text": "w1 w2"}], tok)
    with pytest.raises(GSSError, match="empty reply"):
        encode_replies([{"prompt": "w9", "completion": ""}], tok)


def test_a_jsonl_file_in_each_format(tmp_path, chat_tokenizer):
    path = tmp_path / "data.jsonl"
    rows = [{"text": "w9"}, {"messages": CHAT}, {"prompt": "w1", "completion": " w2"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_texts(path) == ["w9", CHAT, "w1 w2"]
    path.write_text(json.dumps({"input": "w9"}) + "\n")
    with pytest.raises(GSSError, match=r"data.jsonl:1 has keys \['input'\].*'messages'"):
        read_texts(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(GSSError, match=r"data\.jsonl:1 is not a JSON object"):
        read_texts(path)
    path.write_text(json.dumps({"text": "w1", "messages": CHAT}) + "\n")  # which one? refused
    with pytest.raises(GSSError, match=r"data\.jsonl:1 has both 'text' and 'messages'"):
        read_texts(path)
    path.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")  # past the recursion
    with pytest.raises(GSSError, match=r"data\.jsonl:1 is not valid JSON \(nested too deeply"):
        read_texts(path)
    path.write_text(json.dumps({"prompt": "w1"}) + "\n")  # half a pair: the missing half named
    with pytest.raises(GSSError, match=r"data\.jsonl:1 has 'prompt' but no 'completion'"):
        read_texts(path)


def test_conversations_need_a_chat_template_and_well_formed_messages(chat_tokenizer):
    with pytest.raises(GSSError, match="sequence 0 is a conversation, but the tokenizer has no"):
        encode([CHAT], word_tokenizer())
    with pytest.raises(GSSError, match=r"message without 'role' and 'content' \(keys \['text'\]"):
        encode([[{"role": "user", "content": "w1"}, {"text": "w2"}]], chat_tokenizer)
    with pytest.raises(GSSError, match="pass the model's tokenizer"):
        encode([CHAT])


def test_a_chat_prompt_ends_with_the_assistants_turn(chat_tokenizer):
    assert chat_prompt("w3", chat_tokenizer) == "<bos>w40 w3 <eos> w41 "
    with pytest.raises(GSSError, match="drop --chat"):
        chat_prompt("w3", word_tokenizer())


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[1.5, 2, 3]], r"sequence 0 holds a float \(1\.5\) among its token ids"),
        ([[3, 4], [5, "w6"]], r"sequence 1 holds a str \('w6'\)"),
        ([torch.rand(4)], "sequence 0 is a 1-d torch.float32 array"),
        ([torch.ones(2, 3, dtype=torch.long)], "sequence 0 is a 2-d torch.int64 array"),
        (torch.rand(2, 3), "must hold integers, got torch.float32"),
        (torch.ones(2, 3, dtype=torch.bool), "must hold integers, got torch.bool"),
        ([torch.ones(3, dtype=torch.bool)], "sequence 0 is a 1-d torch.bool array"),
        ([[3, True]], r"sequence 0 holds a bool \(True\) among its token ids"),
        ({"text": ["w1"]}, "the texts are one dict: .* or a tokenizer's batch"),
        ([{"input": "w1"}], r"sequence 0 \(a dict\) has keys \['input'\]"),
        ([[3, 4], "w5"], "all texts or all token ids; sequence 0 is a list among texts"),
        ([3, 4, 5], r"wrap it in a list \(\[ids\]\)"),
        ([3.5], "sequence 0 is of type float"),
    ],
)
def test_ids_that_are_not_integers_are_refused(rows, message):
    with pytest.raises(GSSError, match=message):
        encode(rows)
    with pytest.raises(GSSError, match=message):
        encode_compact(rows)


def test_integer_arrays_of_any_kind_are_ids():
    assert encode([np.array([3, 4, 5]), (np.int64(6), 7), torch.tensor([8, 9])]) == [
        [3, 4, 5],
        [6, 7],
        [8, 9],
    ]


@pytest.mark.parametrize("bad", [48, -1])
def test_ids_outside_the_vocabulary_are_refused_before_any_forward(make_model, bad):
    model, ref = make_model("llama"), make_model("llama", seed=1)
    ids = random_ids(4, 8)
    ids[2, 5] = bad
    message = rf"token id {bad} is outside the model's vocabulary \(ids 0 to 47\)"
    with pytest.raises(GSSError, match="the texts: " + message):
        gss.calibrate(model, ref, ids, layer=0, progress=False)
    with pytest.raises(GSSError, match="gen_texts: " + message):
        gss.calibrate(model, ref, random_ids(4, 8), gen_texts=ids, layer=0, progress=False)
    with pytest.raises(GSSError, match="the texts: " + message):
        gss.scan_layers(model, ref, ids, progress=False)
    with pytest.raises(GSSError, match="input_ids: " + message):
        gss.memorization_signal(model, ref, ids)
    rows = ids.tolist()
    with pytest.raises(GSSError, match="memorized: " + message):
        evaluate_model(model, rows, rows, k=2, n=6, progress=False)
    with pytest.raises(GSSError, match="pad_id: token id 99 is outside"):
        evaluate_model(model, rows[:1], rows[:1], k=2, n=6, pad_id=99, progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_input_ids_that_are_not_integers_are_refused_by_the_signal(make_model, dtype):
    model, ref = make_model("llama"), make_model("llama", seed=1)
    with pytest.raises(GSSError, match=rf"input_ids must hold integers, got {dtype}"):
        gss.memorization_signal(model, ref, random_ids(2, 6).to(dtype))


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("tensors", [None, "pt"])
def test_a_tokenizers_batch_is_its_rows_without_the_padding(padding_side, tensors):
    tok = word_tokenizer()
    tok.padding_side = padding_side
    texts = ["w1 w2 w3 w4", "w5 w6", "w7 w8 w9"]
    batch = tok(texts, padding=True, return_tensors=tensors)
    assert encode(batch) == encode(texts, tok) == [tok(t)["input_ids"] for t in texts]
    assert [row.tolist() for row in encode_compact(batch)] == encode(texts, tok)


def test_the_command_line_calibrates_on_conversations_and_prompts_through_the_template(
    tmp_path, chat_tokenizer, capsys
):
    from gss.cli import main

    from .helpers import tiny_model

    for name, seed in (("model", 0), ("reference", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        chat_tokenizer.save_pretrained(tmp_path / name)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"w{i % 40} w{(i * 3) % 40}"},
                {
                    "role": "assistant",
                    "content": " ".join(f"w{(i * 7 + j) % 40}" for j in range(8)),
                },
            ]
        }
        for i in range(16)
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "artifact"
    args = ["--model", str(tmp_path / "model"), "--reference", str(tmp_path / "reference")]
    args += ["--data", str(tmp_path / "chat.jsonl"), "--layer", "1", "--rank", "2"]
    assert main(["calibrate", *args, "--out", str(out), "--no-progress"]) == 0
    tokens = json.loads((out / "gss_config.json").read_text())["provenance"]["token_counts"][
        "tokens"
    ]
    rendered = encode([r["messages"] for r in rows], chat_tokenizer)
    assert tokens == sum(len(s) - 1 for s in rendered)  # every target of the rendered chats
    # --max-length defaults to 512 cut to the model's context (128 positions here)
    long = tmp_path / "long.txt"
    long.write_text("\n".join(" ".join(f"w{(i + j) % 40}" for j in range(200)) for i in range(8)))
    args[args.index("--data") + 1] = str(long)
    assert main(["calibrate", *args, "--out", str(tmp_path / "long"), "--no-progress"]) == 0
    assert main(["calibrate", *args, "--out", str(tmp_path / "x"), "--max-length", "300"]) == 2
    assert "tokens, more than the 128 positions the model takes" in capsys.readouterr().err
    generate = ["generate", "--model", str(tmp_path / "model"), "--steer", str(out)]
    generate += ["--prompt", "w3 w4", "--max-new-tokens", "3"]
    assert main([*generate, "--chat"]) == 0
    assert "steered:" in capsys.readouterr().out
    plain = tmp_path / "plain"  # the same model, its tokenizer without a template
    tiny_model("llama", seed=0).save_pretrained(plain)
    word_tokenizer().save_pretrained(plain)
    assert main([*generate[:2], str(plain), *generate[3:], "--chat"]) == 2
    assert "drop --chat" in capsys.readouterr().err
    # --reply: each conversation prompted with what comes before its reply, matched on it
    evaluate = ["evaluate", "--model", str(tmp_path / "model"), "--no-progress"]
    evaluate += ["--memorized", str(tmp_path / "chat.jsonl"), "--heldout", str(long)]
    evaluate += ["--k", "2", "--n", "6", "--out", str(tmp_path / "ev"), "--reply"]
    assert main(evaluate) == 0
    assert (
        "replies reproduced (their first 4 tokens) of 16 conversations" in capsys.readouterr().out
    )
    record = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert record["reply"] and record["unsteered"]["rows"] == 16
    sweep = ["sweep", *evaluate[1:-3], "--out", str(tmp_path / "sw"), "--steer", str(out)]
    assert main([*sweep, "--deltas", "1", "--reply"]) == 0
    record = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert record["reply"] and record["points"][0]["rows"] == 16
    evaluate[evaluate.index("--memorized") + 1] = str(long)
    assert main([*evaluate, "--overwrite"]) == 2
    assert "has no reply to separate" in capsys.readouterr().err


def test_sequences_longer_than_the_context_are_refused_with_the_fix(make_model):
    from gss.hf.forward import context_length

    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    # learned positions, 128 rows (GPT2Config maps max_position_embeddings to n_positions)
    assert context_length(model) == (128, "max_position_embeddings")
    ids = random_ids(4, 140)
    message = (
        r"sequence 0 has 140 tokens, more than the 128 positions the model takes "
        r"\(config\.max_position_embeddings\)\. Cut the sequences with max_length=128 or less"
    )
    with pytest.raises(GSSError, match="the texts: " + message):
        gss.calibrate(model, ref, ids, layer=0, progress=False)
    with pytest.raises(GSSError, match="input_ids: " + message):
        gss.memorization_signal(model, ref, ids)
    with pytest.raises(GSSError, match="heldout: " + message):
        evaluate_model(model, ids[:, :8].tolist(), ids.tolist(), k=2, n=6, progress=False)
    art = gss.calibrate(model, ref, ids[:, :20], layer=0, progress=False)
    with pytest.raises(
        GSSError, match=r"has 120 tokens, and 10 more to generate make 130.*--max-new"
    ):
        gss.explain(model, art, ids[0, :120], max_new_tokens=10)
    # cut to the context they run; evaluation only runs the candidates' first n tokens
    gss.calibrate(model, ref, ids, layer=0, max_length=128, progress=False)
    report = evaluate_model(model, ids.tolist(), ids[:, :128].tolist(), k=2, n=6, progress=False)
    assert report.rows == 4
    llama = make_model("llama")
    assert context_length(llama) == (128, "max_position_embeddings")


@pytest.mark.parametrize(
    ("scaling", "context"),
    [
        ({"rope_type": "dynamic", "factor": 4.0}, 512),
        ({"rope_type": "linear", "factor": 2.0}, 256),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512),
        # these keep the stretched length in max_position_embeddings themselves
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}, 128),
    ],
)
def test_a_rope_scaling_that_stretches_the_context_raises_the_limit(scaling, context):
    from transformers import LlamaConfig

    from gss.hf.forward import context_length

    model = torch.nn.Module()
    extra = (
        {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        if scaling["rope_type"] == "llama3"
        else {}
    )
    model.config = LlamaConfig(max_position_embeddings=128, rope_scaling={**scaling, **extra})
    length, key = context_length(model)
    assert length == context
    assert key.startswith("max_position_embeddings") and (" x RoPE" in key) == (context != 128)


def test_rows_of_token_ids_are_kept_where_texts_are_read(tmp_path):
    """A .jsonl of input_ids rows has no text to read: every command takes its rows as ids
    (gss audit and evaluate --heldout read texts, and refused them)."""
    from gss.data import read_texts

    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n" + json.dumps({"text": "w1"}) + "\n")
    assert read_texts(path) == [{"input_ids": [5, 6, 7]}, "w1"]
    assert encode(read_texts(path)[:1]) == [[5, 6, 7]]


def test_a_byte_order_mark_an_upper_case_suffix_and_a_pipe_are_read_as_text(tmp_path):
    import os
    import threading

    from gss.data_sources import read_data

    (tmp_path / "bom.TXT").write_bytes("\ufeffw1 w2\nw3\n".encode())
    assert read_data(tmp_path / "bom.TXT") == ["w1 w2", "w3"]
    os.mkfifo(tmp_path / "pipe")

    def write() -> None:
        with open(tmp_path / "pipe", "w") as f:
            f.write("w4 w5\n\nw6\n")

    writer = threading.Thread(target=write)
    writer.start()
    assert read_data(tmp_path / "pipe") == ["w4 w5", "w6"]
    writer.join()
