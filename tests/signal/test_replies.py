"""The warning that a chat fine-tune looks trained on its replies alone (gss.signal.replies)."""

import copy
import json
import warnings

import pytest
import torch

from gss import GSSWarning, calibrate, scan_layers
from gss.cli import main as cli_main
from gss.data import right_pad
from gss.signal.replies import MIN_TOKENS, warn_if_replies_alone
from gss.signal.tokens import encode_trained, reply_masks

from ..helpers import tiny_model
from .test_tokens import MULTI, chat_tokenizer  # noqa: F401 (a fixture)


def _conversations(n=16):
    """Conversations over distinct words: the user's from w3-w22, the assistant's from w23-w39."""
    return [
        [
            {"role": "user", "content": " ".join(f"w{3 + (i * 5 + j) % 20}" for j in range(4))},
            {
                "role": "assistant",
                "content": " ".join(f"w{23 + (i * 3 + j) % 17}" for j in range(6)),
            },
        ]
        for i in range(n)
    ]


def _finetune(reference, rows, tok, replies_only, steps=20):
    """A copy of `reference` trained on `rows`, the loss on the replies alone or on every token."""
    model = copy.deepcopy(reference).train()
    ids, masks = encode_trained(rows, tok, replies_only=replies_only)
    input_ids, attention = right_pad(ids, 0)
    labels = input_ids.masked_fill(attention == 0, -100)
    if masks is not None:
        labels = labels.masked_fill(~right_pad(masks, 0)[0].bool(), -100)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def _warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category, GSSWarning)]


def test_reply_masks_follow_the_sequences(chat_tokenizer):  # noqa: F811
    tok = chat_tokenizer
    rows = ["w3 w4 w5", "w6", {"messages": MULTI}, {"text": "w7 w8"}, MULTI]
    masks = reply_masks(rows, tok, None)
    ids, _ = encode_trained(rows, tok)
    # "w6" is one token, dropped from the sequences as from the masks; plain text has no replies
    assert len(masks) == len(ids) == 4
    assert masks[0] is None and masks[2] is None
    (reply,) = encode_trained([MULTI], tok, replies_only=True)[1]
    assert masks[1].tolist() == masks[3].tolist() == reply.tolist()
    assert reply_masks(["w3 w4", "w5 w6"], tok, None) is None
    assert reply_masks(torch.ones(2, 4, dtype=torch.long), tok, None) is None
    assert len(reply_masks([MULTI] * 5, tok, None, rows=3)) == 3

    class Rows:  # iterable, not a sequence, like a `datasets.Dataset`: only its head is read
        def __iter__(self):
            yield from [{"messages": MULTI}] * 3
            raise AssertionError("read past the rows checked")

    assert len(reply_masks(Rows(), tok, None, rows=3)) == 3


def test_replies_alone_warns_every_token_does_not(chat_tokenizer):  # noqa: F811
    tok = chat_tokenizer
    reference = tiny_model("llama", seed=0)
    rows = _conversations()
    general = [" ".join(f"w{3 + (i * 7 + j) % 37}" for j in range(8)) for i in range(8)]
    common = dict(tokenizer=tok, layer=1, rank=2, gen_texts=general, progress=False)
    replies = _finetune(reference, rows, tok, replies_only=True)
    artifact, said = _warnings(lambda: calibrate(replies, reference, rows, **common))
    assert len(said) == 1 and "looks trained on the replies alone" in said[0]
    assert "replies_only=True (--replies-only)" in said[0]
    found = artifact.provenance.token_counts["replies"]
    assert found["rows"] == 16 and found["reply_tokens"] == 16 * 7  # six words and the EOS
    assert found["other_omega_mean"] < 0.2 * found["reply_omega_mean"]
    assert f"omega on 16 conversations: {found['reply_omega_mean']:.2f} nats" in artifact.describe()
    _, said = _warnings(
        lambda: scan_layers(replies, reference, rows, tokenizer=tok, progress=False)
    )
    assert len(said) == 1 and "replies alone" in said[0]
    # restricted to the replies: nothing to warn about, nothing compared
    options = {**common, "replies_only": True}
    artifact, said = _warnings(lambda: calibrate(replies, reference, rows, **options))
    assert said == [] and "replies" not in artifact.provenance.token_counts
    # trained on every token: the user's turns and the template moved too
    everything = _finetune(reference, rows, tok, replies_only=False)
    artifact, said = _warnings(lambda: calibrate(everything, reference, rows, **common))
    found = artifact.provenance.token_counts["replies"]
    assert said == [] and found["other_omega_mean"] > 0.2 * found["reply_omega_mean"] > 0


def test_the_warning_needs_enough_tokens_on_each_side():
    result = {"rows": 3, "reply_tokens": MIN_TOKENS, "reply_omega_mean": 2.0}
    result.update(other_tokens=MIN_TOKENS, other_omega_mean=0.0)
    with pytest.warns(GSSWarning, match="2.00 nats on the 64 tokens of the replies"):
        warn_if_replies_alone(result)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_replies_alone({**result, "other_tokens": MIN_TOKENS - 1})
        warn_if_replies_alone({**result, "other_omega_mean": None})
        warn_if_replies_alone({**result, "reply_omega_mean": 0.4, "other_omega_mean": -0.1})
        warn_if_replies_alone({**result, "other_omega_mean": 0.5})
        warn_if_replies_alone(None)


def test_cli_layers_and_signal_say_it_in_one_line(tmp_path, capsys, chat_tokenizer):  # noqa: F811
    reference = tiny_model("llama", seed=0)
    rows = _conversations()
    model = _finetune(reference, rows, chat_tokenizer, replies_only=True)
    for m, name in ((model, "model"), (reference, "ref")):
        m.save_pretrained(tmp_path / name)
        chat_tokenizer.save_pretrained(tmp_path / name)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    args = ["layers", "--model", str(tmp_path / "model"), "--reference", str(tmp_path / "ref")]
    args += ["--data", str(data), "--out", str(tmp_path / "scan"), "--no-progress"]
    assert cli_main([*args, "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "gss: warning: omega averages" in err and "(--replies-only)" in err
    assert cli_main([*args, "--device", "cpu", "--replies-only", "--overwrite"]) == 0
    assert "gss: warning" not in capsys.readouterr().err
    # `gss signal` reports omega on the replies and on the rest, and warns the same way
    signal = ["signal", *args[1:7], "--out", str(tmp_path / "signal"), "--no-progress"]
    assert cli_main([*signal, "--device", "cpu"]) == 0
    assert "gss: warning: omega averages" in capsys.readouterr().err
    report = json.loads((tmp_path / "signal" / "signal.json").read_text())
    options = dict(
        tokenizer=chat_tokenizer, layer=1, rank=2, gen_texts=["w3 w4 w5"], progress=False
    )
    artifact, _ = _warnings(lambda: calibrate(model, reference, rows, **options))
    found = artifact.provenance.token_counts["replies"]
    assert report["replies"] == pytest.approx(found, rel=1e-4)
