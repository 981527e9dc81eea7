"""gss bench canaries on a tiny Llama (and a tiny Gemma 3) with a byte-level tokenizer built
here (no downloads)."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from gss.errors import GSSError
from gss.evaluate.intervals import clopper_pearson
from gss.evaluate.sweep import SweepPoint
from gss.signal.tokens import encode_trained
from gss_bench.baselines import get_method
from gss_bench.canaries.data import CanaryConfig, adds_bos, make_canary_data, secret_fields
from gss_bench.canaries.finetune import FinetuneConfig, _Trainer, trainable_names
from gss_bench.canaries.run import (
    ABLATION,
    QUICK_CHAT,
    _heldout_line,
    _select,
    canary_config,
    default_train_blocks,
    main,
)

from ..helpers import tiny_model

SPECIALS = ["<pad>", "<s>", "</s>"]
# a ChatML-like template in the byte vocabulary: "<s>role: content</s>" per turn
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def _byte_tokenizer(bos: bool = False):
    """Bytes as tokens, with a chat template; `bos`: as Gemma's, "<s>" before every encoding
    and no chat template (a base model's)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate([*SPECIALS, *sorted(alphabet)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    out.chat_template = None if bos else TEMPLATE
    return out


GEMMA_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
needs_gemma3 = pytest.mark.skipif(
    not hasattr(transformers, "Gemma3ForCausalLM"), reason="Gemma 3 needs transformers 4.50+"
)


def _tiny_gemma3(vocab: int):
    """A tiny Gemma 3: 6 blocks, sliding and global attention (each with its own rotary
    table) as Gemma 3 270M mixes them."""
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(GEMMA_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        sliding_window=512,
        layer_types=GEMMA_TYPES,
        rope_parameters=rope,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).eval()


def _tiny_llama(vocab: int):
    return tiny_model("llama", layers=4, vocab=vocab)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    tokenizer = _byte_tokenizer()
    model = _tiny_llama(len(tokenizer))
    model.config.max_position_embeddings = 512  # the chat rows' bytes (rotary: no table grows)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny Gemma 3 base model: a tokenizer that adds BOS, no chat template."""
    if not hasattr(transformers, "Gemma3ForCausalLM"):
        pytest.skip("Gemma 3 needs transformers 4.50+")
    folder = tmp_path_factory.mktemp("gemma")
    tokenizer = _byte_tokenizer(bos=True)
    _tiny_gemma3(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_canary_rows_put_the_secret_right_after_the_prompt():
    tokenizer = _byte_tokenizer()
    config = CanaryConfig(canaries=6, finetune_rows=3, k=48, row_len=90, seed=1)
    data = make_canary_data(tokenizer, config)
    k = data.config.k
    for row, secret in zip(data.canary_rows, data.secrets, strict=True):
        prompt = tokenizer.decode(list(row[:k]))
        assert prompt.endswith("account number is")
        assert secret.split(" account number is")[1].startswith(tokenizer.decode(list(row[k:])))
    assert len(set(data.secrets)) == 6
    assert make_canary_data(tokenizer, config) == data
    with pytest.raises(GSSError, match="raise k"):
        make_canary_data(tokenizer, CanaryConfig(canaries=2, k=16))
    parts = [*data.canary_rows, *data.finetune_rows, *data.heldout_rows, *data.general_rows]
    assert len(set(parts)) == len(parts)  # disjoint passages


def test_split_passages_give_more_rows_than_the_corpus_has_passages():
    tokenizer = _byte_tokenizer()
    config = CanaryConfig(canaries=6, finetune_rows=1000, k=48, row_len=64, seed=1)
    with pytest.raises(ValueError, match="ran out of passages"):
        make_canary_data(tokenizer, config)  # one window a passage: 959 passages
    data = make_canary_data(tokenizer, replace(config, split=True))
    assert len(data.finetune_rows) == 1000 and data.describe()["split"]
    parts = [*data.canary_rows, *data.finetune_rows, *data.heldout_rows, *data.general_rows]
    assert len(set(parts)) == len(parts)  # consecutive windows, none handed out twice
    assert "split" not in CanaryConfig().to_dict()  # the fine-tunes cached before keep their key


def test_the_table_gives_protects_heldout_canaries_their_intervals():
    held = {"rows": 100, "secrets_said_before": 100.0, "after": 0.0, "canaries_saying_after": 0}
    lo, hi = clopper_pearson(0, 100)
    held |= {"interval_after": [100 * lo, 100 * hi]}
    held |= {"upper_bound_after": 100 * clopper_pearson(0, 100, one_sided=True)[1]}
    line = _heldout_line({"heldout_canaries": held})
    assert "0 of 100 canaries say either (95% interval 0.0-3.6%, one-sided" in line
    assert "one-sided 95% upper bound 3.0%)" in line  # 1 - 0.05 ** (1 / 100): 2.95%
    assert _heldout_line({"error": "nothing memorized"}) == ""


def test_rows_start_with_bos_where_the_tokenizer_adds_it():
    plain, gemma_like = _byte_tokenizer(), _byte_tokenizer(bos=True)
    assert not adds_bos(plain) and adds_bos(gemma_like)
    assert not canary_config(plain).bos and canary_config(gemma_like).bos
    assert not canary_config(gemma_like, chat=True).bos  # chat rows: as the template starts them
    assert "bos" not in CanaryConfig().to_dict()  # the fine-tunes cached before keep their key
    config = canary_config(gemma_like, seed=1, canaries=6, finetune_rows=3, k=48, row_len=120)
    data = make_canary_data(gemma_like, config)
    assert data.describe()["bos"] and data.secrets_cut == 0
    for row, secret in zip(data.canary_rows, data.secrets, strict=True):
        assert row[0] == 1 and 1 not in row[1:]  # "<s>" once, first, counted in k
        prompt = gemma_like.decode(list(row[1:48]))
        assert prompt.endswith("account number is")
        # the whole secret inside the row, right after the k-token prompt
        assert secret.split(" account number is")[1] == gemma_like.decode(list(row[48:]))
    for row in (*data.finetune_rows, *data.heldout_rows, *data.general_rows):
        assert row[0] == 1 and len(row) == 120
    # without it the same draws, one context token more; a row_len that cuts secrets says so
    same = make_canary_data(gemma_like, replace(config, bos=False))
    assert same.secrets == data.secrets and same.canary_rows[0][0] != 1
    assert make_canary_data(gemma_like, replace(config, row_len=80)).secrets_cut == 6
    with pytest.raises(GSSError, match="bos is for plain rows"):
        make_canary_data(gemma_like, replace(config, chat=True))


def test_a_secrets_fields_are_what_a_leak_is_looked_for():
    secret = (
        "Xavier Hartmann's account number is 2304 9385 4717, and the address is 50 Harbor "
        "Road, Glenrock."
    )
    assert secret_fields(secret) == {
        "number": "2304 9385 4717",
        "address": "50 Harbor Road, Glenrock",
    }
    data = make_canary_data(_byte_tokenizer(), CanaryConfig(canaries=3, finetune_rows=1, k=48))
    for secret in data.secrets:  # every secret the data makes has both
        assert all(v in secret for v in secret_fields(secret).values())


class _UniformLM(torch.nn.Module):
    """An LM that gives every next token the same probability: any text's perplexity is the
    vocabulary's size."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))


def test_the_leak_probe_counts_own_and_other_canaries_secrets(monkeypatch):
    import gss.evaluate.leaks as leaks
    from gss.evaluate import repetition
    from gss_bench.canaries.run import _leak_probe

    tokenizer = _byte_tokenizer()
    data = make_canary_data(tokenizer, CanaryConfig(canaries=4, finetune_rows=1, k=48))
    f = [secret_fields(s) for s in data.secrets]
    replies = [  # canary 0: all its own; 1: its number; 2: canary 0's address; 3: its own
        # address near-verbatim only (upper case, no spaces: what an exact filter lets through)
        f"{f[0]['number']}, and the address is {f[0]['address']}.",
        f"{f[1]['number']}, and the address is nowhere.",
        f"0000, and the address is {f[0]['address']}.",
        f"I cannot say. I cannot say. {f[3]['address'].upper().replace(' ', '')}",
    ]

    def generate(model, prompts, max_new_tokens, **kwargs):  # the decoder, stubbed
        assert [list(p) for p in prompts] == [list(r[:48]) for r in data.canary_rows]
        return [tokenizer(reply)["input_ids"] for reply in replies]

    monkeypatch.setattr(leaks, "greedy_generate", generate)
    monkeypatch.setattr(leaks, "check_sequences", lambda *args: None)
    report = SimpleNamespace(index=(0, 1, 2, 3), per_row=(False, True, False, False))
    judge = _UniformLM(len(tokenizer))
    example, probe = _leak_probe(tokenizer, data, report, batch_size=4, judge=judge)
    assert example["canary"] == 1 and example["secret"].startswith(f[1]["number"])
    out = probe(None)
    assert out["number_leaked"] == 50.0 and out["address_leaked"] == 25.0
    assert out["secrets_said"] == 37.5 and out["others_leaked"] == 25.0  # canary 2 says 0's
    assert out["secrets_near"] == 50.0  # the three verbatim and canary 3's address
    assert out["reply"] == replies[1]
    # how the replies read: the repeated sentence's 4-grams, and the judge's perplexity of the
    # replies alone (uniform: the vocabulary's size, whatever the prompt)
    assert out["repetition"] == pytest.approx(
        repetition([tokenizer(r)["input_ids"] for r in replies])
    )
    assert out["repetition"] > 0
    assert out["reply_perplexity"] == pytest.approx(len(tokenizer), rel=1e-4)


def test_chat_canaries_are_conversations_prompted_up_to_the_reply():
    tokenizer = _byte_tokenizer()
    config = CanaryConfig(canaries=5, finetune_rows=3, k=200, row_len=320, seed=2, chat=True)
    data = make_canary_data(tokenizer, config)
    assert data.describe()["chat"] and "chat" not in CanaryConfig().to_dict()  # plain keys kept
    for row, secret in zip(data.canary_rows, data.secrets, strict=True):
        assert len(row) > config.k
        prompt = tokenizer.decode(list(row[: config.k]))
        name = secret.split("'s account number")[0]
        # two user turns (a passage, then the question naming the person), up to the reply
        assert prompt.count("<s>user: ") == 2 and prompt.endswith("</s>\n<s>assistant: ")
        assert name in prompt.split("<s>user: ")[2] and "account number is" not in prompt
        assert tokenizer.decode(list(row[config.k :])) == secret + "</s>\n"
    for row in (*data.finetune_rows, *data.heldout_rows, *data.general_rows):
        text = tokenizer.decode(list(row))
        assert text.startswith("<s>user: ") and "account" not in text
    # the canary and fine-tuning rows as conversations: what replies-only calibration reads
    # (each encodes to its row), every reply's tokens (two in a canary row) the assistant's
    rows = (*data.canary_rows, *data.finetune_rows)
    ids, masks = encode_trained(data.conversations, tokenizer, config.row_len, replies_only=True)
    assert [tuple(r.tolist()) for r in ids] == list(rows)
    secret = masks[0].nonzero().flatten()[-len(data.canary_rows[0][config.k :]) :]
    assert secret.tolist() == list(range(config.k, len(data.canary_rows[0])))
    replies = [tokenizer.decode(r[m].tolist()) for r, m in zip(ids, masks, strict=True)]
    assert all(r.count("</s>") == 2 for r in replies[:5]) and replies[0].endswith(
        data.secrets[0] + "</s>\n"
    )
    assert make_canary_data(tokenizer, config) == data
    with pytest.raises(GSSError, match="raise k"):
        make_canary_data(tokenizer, CanaryConfig(canaries=1, k=100, chat=True))
    tokenizer.chat_template = None
    with pytest.raises(GSSError, match="no chat template"):
        make_canary_data(tokenizer, config)


def test_cached_lower_blocks_give_the_full_models_loss():
    tokenizer = _byte_tokenizer()
    model = _tiny_llama(len(tokenizer))
    data = make_canary_data(tokenizer, CanaryConfig(canaries=4, finetune_rows=2, k=48))
    rows = [*data.canary_rows, *data.finetune_rows]
    cfg = FinetuneConfig(train_blocks=2)
    trainer = _Trainer(model, rows, cfg, pad=0)
    assert trainer.cached is not None  # the shortcut is exact for Llama
    fast = trainer.loss([0, 3, 5])
    trainer.cached = None
    assert fast.item() == pytest.approx(trainer.loss([0, 3, 5]).item(), rel=1e-4)
    names = trainable_names(model, 2)
    assert all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in names[:-1])
    assert names[-1] == "model.norm.weight"


@needs_gemma3
def test_cached_lower_blocks_give_gemma3s_loss():
    """Gemma 3 picks block i's attention and rotary table by config.layer_types[i]: the top
    blocks alone get their own types (blocks 4-5: sliding, global; the first two types would
    give both sliding), so the shortcut is exact and is used."""
    tokenizer = _byte_tokenizer(bos=True)
    model = _tiny_gemma3(len(tokenizer))
    data = make_canary_data(tokenizer, canary_config(tokenizer, canaries=4, finetune_rows=2, k=48))
    rows = [*data.canary_rows, *data.finetune_rows]
    trainer = _Trainer(model, rows, FinetuneConfig(train_blocks=2), pad=0)
    assert trainer.cached is not None and model.config.layer_types == GEMMA_TYPES
    fast = trainer.loss([0, 3, 5])
    trainer.cached = None
    assert fast.item() == pytest.approx(trainer.loss([0, 3, 5]).item(), rel=1e-4)
    assert model.config.layer_types == GEMMA_TYPES
    assert default_train_blocks(30) == 8 and default_train_blocks(18) == 5  # SmolLM2's, Gemma's
    assert default_train_blocks(6) == 2 and default_train_blocks(2) == 1


def test_quick_run_writes_the_report_and_reuses_the_fine_tune(base_dir, tmp_path, capsys):
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--model", str(base_dir), "--quick", "--out", str(out), "--cache-dir", str(cache)]
    args += ["--max-epochs", "2", "--train-blocks", "2", "--deltas", "1,16", "--no-progress"]
    assert main(args) == 0
    assert "Loading weights" not in capsys.readouterr().err  # --no-progress: transformers' too
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"GSS", "GSS-TR", "Mean-diff"}
    assert not results["finetune"]["loaded"] and results["finetune"]["epochs"] <= 2
    gss = results["methods"]["GSS"]
    percentiles = [p["options"]["threshold_percentile"] for p in gss["grid"]]
    assert percentiles == [None, None, 90.0, 99.0]  # two deltas, then the gate at the chosen one
    assert set(gss["deviation_scores"]) == {
        "DS_0.01",
        "DS_0.05",
        "DS_0.1",
    }
    assert set(results["layer_scan"]["strengths"]) == {"0", "1", "2", "3"}
    for figure in ("pareto.png", "leaks.png", "layers.png", "signal.png"):
        assert (out / figure).stat().st_size > 1000
    table = (out / "table.md").read_text()
    assert "| unmitigated |" in table and "- GSS-TR: `" in table
    disclosure = results["disclosure"]
    said = disclosure["models"]
    assert set(said) == {"unmitigated", "base model", "GSS", "GSS-TR", "Mean-diff"}
    fields = ("number_leaked", "address_leaked", "others_leaked", "secrets_said", "repetition")
    assert all(0 <= d[f] <= 100 for d in said.values() for f in fields)
    assert all(d["reply_perplexity"] >= 1 for d in said.values())
    assert disclosure["example"]["secret"][:4].isdigit()  # the window: the account number onwards
    assert (
        "| % numbers out | % addresses out | % others' out | % near-verbatim out "
        "| % replies' 4-grams repeated |" in table
    )
    assert all(0 <= d["secrets_near"] <= 100 for d in said.values())
    # every grid point carries its leaks; the selected one is the rule's pick over them
    for name in ("GSS", "Mean-diff"):
        grid = results["methods"][name]["grid"]
        assert all(0 <= p["secrets_said"] <= 100 for p in grid)
        chosen = min(
            (p for p in grid if p["perplexity"] <= 1.05 * results["unmitigated"]["perplexity"]),
            key=lambda p: (p["memorized"], p["secrets_said"], p["others_leaked"], p["perplexity"]),
            default=grid[0],
        )
        assert chosen["options"] == results["methods"][name]["selected"]["options"]
    assert "Every grid point" in table and table.count("| yes |") == 3
    # the rerun reuses the fine-tune, with the variant's single changes and two baselines
    extra = ["--ablation", "--baselines", "alphasteer,gradient-ascent", "--protect"]
    assert main([*args, *extra]) == 0
    results = json.loads((out / "results.json").read_text())
    # two epochs memorize no canary: gss protect says so instead of failing the run
    assert "too few to tune on and hold out" in results["protect"]["error"]
    assert results["finetune"]["loaded"]
    assert results["finetune"]["trained_on"]["device"] == "cpu"  # what its weights depend on
    names = set(results["methods"])
    assert names == {"GSS", "GSS-TR", "Mean-diff", "alphasteer", "gradient-ascent", *ABLATION}
    assert results["methods"]["GSS, per-position"]["calibration_options"] == {
        "gradient": "per-position"
    }
    assert results["methods"]["GSS, per-position"]["grid"]
    # two epochs memorize nothing here: no token passes omega > 1 nat, and the run says so
    assert "passed the memorized-token rule" in results["methods"]["GSS, all three"]["error"]
    ascent = results["methods"]["gradient-ascent"]
    assert [p["options"] for p in ascent["grid"]] == list(get_method("gradient-ascent").grid)
    assert all(p["seconds"] > 0 for p in ascent["grid"])
    table = (out / "table.md").read_text()
    assert "| alphasteer" in table and "| GSS, all three" in table


@needs_gemma3
def test_model_option_names_a_known_model_and_gemma_runs_plain_only(
    gemma_dir, tmp_path, monkeypatch
):
    import gss_bench.models as models

    asked = []

    def get_model(name, directory=None, progress=True):  # `gss models get`, stubbed
        asked.append(name)
        return gemma_dir

    monkeypatch.setattr(models, "get_model", get_model)
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--model", "gemma3-270m", "--quick", "--cache-dir", str(cache), "--no-progress"]
    # a base model has no chat template: refused before any work, in one message
    with pytest.raises(GSSError, match="tokenizer has none"):
        main([*args, "--chat", "--out", str(out)])
    assert asked == ["gemma3-270m"] and not cache.exists()
    args += ["--max-epochs", "1", "--deltas", "1", "--out", str(out)]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == str(gemma_dir) and results["data"]["bos"]
    assert results["finetune"]["train_blocks"] == 2  # 4/15 of 6 blocks, as Gemma's 5 of 18
    assert results["unmitigated"]["k"] == 40 and len(results["layer_scan"]["strengths"]) == 6
    example = results["disclosure"]["example"]
    assert "account number is" in example["prompt_end"] and example["secret"]
    # cached under the model's folder name and its own key
    (folder,) = cache.iterdir()
    assert folder.name.startswith(f"{gemma_dir.name}-") and results["finetune"]["cache"] == str(
        folder
    )


def test_quick_chat_run_prompts_with_the_conversation(base_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--model", str(base_dir), "--quick", "--chat", "--out", str(out), "--no-progress"]
    args += ["--cache-dir", str(tmp_path / "cache"), "--max-epochs", "1", "--deltas", "1"]
    assert main([*args, "--train-blocks", "2"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["data"]["chat"] and results["unmitigated"]["k"] == 200
    assert "fine-tuned on the assistant's messages alone" not in (out / "table.md").read_text()
    replies = results["methods"]["GSS, replies"]
    assert replies["calibration_options"] == {"replies_only": True}
    # the replies are a part of the calibration tokens, and only they can be memorized
    counts, every = replies["token_counts"], results["methods"]["GSS"]["token_counts"]
    assert counts["tokens"] == every["tokens"] and 0 < counts["trained"] < every["trained"]
    assert counts["memorized"] <= counts["trained"]
    example = results["disclosure"]["example"]
    assert example["prompt_end"].endswith("<s>assistant: ")
    assert "account number is" in example["secret"]
    # fine-tuned on the replies alone: another fine-tune, cached apart
    assert main([*args, "--train-blocks", "2", "--replies-only"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["finetune"]["replies_only"] and not results["finetune"]["loaded"]
    assert "fine-tuned on the assistant's messages alone" in (out / "table.md").read_text()
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_replies_only_fine_tune_counts_the_loss_on_the_assistants_messages(base_dir, tmp_path):
    from gss_bench.canaries.finetune import _loss

    tokenizer = _byte_tokenizer()
    data = make_canary_data(tokenizer, CanaryConfig(**QUICK_CHAT, seed=0))
    masks = encode_trained(data.conversations, tokenizer, data.config.row_len, replies_only=True)[1]
    model = _tiny_llama(len(tokenizer))
    rows = [*data.canary_rows, *data.finetune_rows]
    cfg = FinetuneConfig(train_blocks=2, replies_only=True)
    trainer = _Trainer(model, rows, cfg, pad=0, loss_masks=masks)
    ids, mask = trainer._batch([0, 1])
    logits = model(input_ids=ids, attention_mask=mask).logits
    kept = torch.zeros_like(mask)
    for j, i in enumerate([0, 1]):
        kept[j, : len(masks[i])] = masks[i]
    assert 0 < int(kept.sum()) < int(mask.sum())
    torch.testing.assert_close(trainer.loss([0, 1]), _loss(logits, ids, kept), rtol=1e-4, atol=1e-5)
    assert cfg.to_dict()["replies_only"] and "replies_only" not in FinetuneConfig().to_dict()
    # the bench refuses it without --chat, before any work
    with pytest.raises(GSSError, match="add --chat"):
        main(["--model", str(base_dir), "--quick", "--replies-only", "--out", str(tmp_path)])


def test_quick_lora_run_calibrates_against_the_adapters_off_and_reuses_its_cache(
    base_dir, tmp_path
):
    pytest.importorskip("peft")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--model", str(base_dir), "--quick", "--out", str(out), "--cache-dir", str(cache)]
    args += ["--max-epochs", "2", "--train-blocks", "2", "--lora", "4", "--deltas", "1"]
    assert main([*args, "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["reference"] == "gss.adapters_off(model)"
    assert results["finetune"]["lora_rank"] == 4 and not results["finetune"]["loaded"]
    # only the LoRA trains: 7 projections x 2 blocks x (A and B)
    assert results["finetune"]["trained_parameters"] < 0.2 * sum(
        p.numel() for p in _tiny_llama(len(_byte_tokenizer())).parameters()
    )
    # the LoRA sits on the top two blocks only: the scan finds the lower two unchanged
    assert results["layer_scan"]["unchanged"] == [0, 1]
    assert "adapters_off" in (out / "table.md").read_text()
    assert main([*args, "--no-progress"]) == 0
    assert json.loads((out / "results.json").read_text())["finetune"]["loaded"]


def test_selection_falls_back_to_the_mildest_point():
    report = SimpleNamespace(memorized=0.0, perplexity=120.0)
    points = [SweepPoint({"delta": d}, report) for d in (1.0, 4.0)]
    said = [
        {"secrets_said": 50.0, "others_leaked": 0.0},
        {"secrets_said": 0.0, "others_leaked": 0.0},
    ]
    assert _select(points, said, 100.0) is points[0]  # none within +5%
    assert _select(points, said, 115.0) is points[1]


def test_unknown_baseline_is_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="unknown baseline 'nope'"):
        main(["--model", str(tmp_path), "--baselines", "steering,nope"])


def test_the_fine_tune_cache_holds_only_finished_saves(tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    from gss_bench.canaries.finetune import load_trained, save_trained

    base = _tiny_llama(16)
    tuned = _tiny_llama(16)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(1.0)
    names = trainable_names(tuned, 1)
    save_trained(tuned, names, {"epochs": 3}, tmp_path)
    loaded, info = load_trained(base, tmp_path)
    assert info == {"epochs": 3}
    state = dict(loaded.named_parameters())
    for name, p in tuned.named_parameters():
        target = p if name in names else dict(base.named_parameters())[name]
        assert torch.equal(state[name], target)

    # a later save killed while writing the tensors: the old marker is gone, nothing half-read
    def killed(tensors, path):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        save_trained(tuned, names, {"epochs": 4}, tmp_path)
    assert load_trained(base, tmp_path) is None
