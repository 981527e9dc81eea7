import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gss.report import cpu_capability, cpu_info
from gss_bench import trained_on
from gss_bench.tinymem import train
from gss_bench.tinymem.data import PAD, MathConfig, batch_rows, make_data
from gss_bench.tinymem.model import ModelConfig, from_hf, new_model, to_hf
from gss_bench.tinymem.train import (
    Preset,
    TrainConfig,
    _key,
    get_models,
    get_preset,
    train_model,
)


@pytest.mark.parametrize("activation", ["relu", "gelu_new"])
def test_lean_model_converts_exactly_to_hf(activation):
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, activation=activation, n_positions=40)
    lean = new_model(cfg, seed=1)
    with torch.no_grad():  # perturb every weight so that no parameter is left at its init
        for p in lean.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf = to_hf(lean)
    ids = torch.randint(0, 13, (3, 40), generator=torch.Generator().manual_seed(0))
    ids[1, 30:] = PAD
    with torch.no_grad():
        a = lean(ids)
        b = hf(input_ids=ids).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        labels = ids.clone()
        labels[labels == PAD] = -100
        torch.testing.assert_close(lean.loss(ids, PAD), hf(input_ids=ids, labels=labels).loss)
    back = from_hf(hf, cfg)
    for (ka, va), (kb, vb) in zip(
        lean.state_dict().items(), back.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()


def test_init_follows_hf_gpt2():
    cfg = ModelConfig(n_layer=4, n_embd=128)
    lean = new_model(cfg, seed=0)
    std = lean.transformer.h[0].attn.c_attn.weight.std().item()
    assert std == pytest.approx(0.8 / 128**0.5, rel=0.05)
    proj = lean.transformer.h[0].mlp.c_proj.weight.std().item()
    assert proj == pytest.approx(0.8 / 128**0.5 / (2 * 4) ** 0.5, rel=0.05)


TINY = Preset(
    data=MathConfig(
        task="increment",
        num_main=60,
        num_test=10,
        num_aux=12,
        num_aux_test=4,
        num_noise=10,
        length=6,
        start=1000,
        prompt_len=10,
        window=10,
    ),
    model=ModelConfig(n_layer=1, n_embd=16, n_head=2),
    train=TrainConfig(epochs=3, batch_size=16, eval_every=2, snapshots=(2,)),
    reference=TrainConfig(epochs=2, batch_size=16),
)


def test_models_are_cached(tmp_path: Path):
    mem, ref, data, info = get_models(
        "math_noise", TINY, seed=0, cache_dir=tmp_path, progress=False
    )
    assert not info["memorizing"]["loaded"] and not info["reference"]["loaded"]
    log = info["memorizing"]["log"]
    assert [e["epoch"] for e in log["epochs"]] == [1, 2, 3]
    assert {"mem", "correct", "acc_main"} <= set(log["epochs"][1])
    assert log["tokens_per_second"] > 0
    folder = Path(info["memorizing"]["cache"])
    assert folder.parent == tmp_path
    saved = json.loads((folder / "training.json").read_text())
    assert saved["role"] == "memorizing"
    # what the weights depend on beyond seed and configs: the CPU's vector instructions
    expected = {"torch": torch.__version__, "device": "cpu", **cpu_info()}
    assert saved["trained_on"] == {**expected, "threads": torch.get_num_threads()}
    assert cpu_info()["cpu"] and cpu_info()["cpu_capability"]

    mem2, ref2, data2, info2 = get_models(
        "math_noise", TINY, seed=0, cache_dir=tmp_path, progress=False
    )
    assert info2["memorizing"]["loaded"] and info2["reference"]["loaded"]
    assert data2 == data
    ids = batch_rows(data.test["main"], PAD)
    with torch.no_grad():
        assert torch.equal(mem(ids).logits, mem2(ids).logits)
        assert torch.equal(ref(ids).logits, ref2(ids).logits)
        assert not torch.equal(mem(ids).logits, ref(ids).logits)

    # the snapshot at epoch 2 is an earlier checkpoint that loads without training
    _, _, _, info3 = get_models(
        "math_noise", TINY, seed=0, cache_dir=tmp_path, progress=False, memorizing_epochs=2
    )
    assert info3["memorizing"]["loaded"]
    assert len(list(tmp_path.iterdir())) == 3
    snap = json.loads((Path(info3["memorizing"]["cache"]) / "training.json").read_text())
    assert snap["trained_on"] == saved["trained_on"]

    # a model some other vector instructions trained (cached before the key held them) is
    # trained again, not loaded
    saved["trained_on"]["cpu_capability"] = "AVX512" if cpu_capability() == "AVX2" else "AVX2"
    (folder / "training.json").write_text(json.dumps(saved))
    _, _, _, info5 = get_models("math_noise", TINY, seed=0, cache_dir=tmp_path, progress=False)
    assert not info5["memorizing"]["loaded"] and info5["reference"]["loaded"]
    assert info5["memorizing"]["cache"] == str(folder)

    # a different seed is a different model
    _, _, _, info4 = get_models(
        "math_noise", TINY, seed=1, cache_dir=tmp_path, progress=False, reference_epochs=1
    )
    assert not info4["memorizing"]["loaded"]


def test_reference_trains_without_noised_rows(tmp_path: Path):
    data = make_data(TINY.data, 0)
    _, _, _, info = get_models("math_noise", TINY, seed=0, cache_dir=tmp_path, progress=False)
    assert info["reference"]["data_stats"]["reference_train_rows"] == len(data.reference_train)
    # the reference saw fewer training tokens per epoch (no noised rows)
    mem_tok = info["memorizing"]["log"]["train_tokens"] / 3
    ref_tok = info["reference"]["log"]["train_tokens"] / 2
    assert ref_tok < mem_tok


def test_named_presets():
    for setting in ("math_noise", "math_backdoor", "lang_noise", "lang_backdoor"):
        for name in ("quick", "default", "paper"):
            pre = get_preset(setting, name)
            assert pre.data.setting == setting
    with pytest.raises(ValueError):
        get_models("math_backdoor", TINY)


def test_cosine_schedule_decays_and_keeps_old_cache_keys(monkeypatch):
    data = make_data(TINY.data, 0)
    model = new_model(replace(TINY.model, vocab_size=data.vocab_size), seed=0)
    tcfg = TrainConfig(epochs=3, batch_size=16, lr_schedule="cosine")
    log = train_model(model, data.train[:64], tcfg, pad_id=PAD, seed=0, progress=False)
    lrs = [e["lr"] for e in log["epochs"]]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] < tcfg.lr and lrs[-1] < 0.05 * tcfg.lr
    with pytest.raises(ValueError, match="snapshots"):
        TrainConfig(epochs=3, snapshots=(2,), lr_schedule="cosine")
    with pytest.raises(ValueError, match="lr_schedule"):
        TrainConfig(epochs=3, lr_schedule="linear")
    # the option is left out of a constant-lr run's key: models cached before it existed load
    monkeypatch.setattr(trained_on, "cpu_capability", lambda: "AVX2")  # the keys' own CPU
    monkeypatch.setattr(trained_on.torch, "get_num_threads", lambda: 2)  # and threads
    pre = get_preset("lang_backdoor", "default")
    key = _key("lang_backdoor", "memorizing", 0, pre.data, pre.model, pre.train)
    assert key == "lang_backdoor-memorizing-e10-258f36fcbdb79f29"
    # so are fields that only add evaluation rows
    fewer = replace(pre.data, extra_poison_test=0)
    assert _key("lang_backdoor", "memorizing", 0, fewer, pre.model, pre.train) == key
    cosine = replace(pre.train, lr_schedule="cosine")
    assert _key("lang_backdoor", "memorizing", 0, pre.data, pre.model, cosine) != key


def test_tracked_epochs_print_a_line_without_a_bar(capsys):
    """Worker processes train without progress bars; the tracked epochs still show."""
    data = make_data(TINY.data, 0)
    model = new_model(replace(TINY.model, vocab_size=data.vocab_size), seed=0)
    tcfg = TrainConfig(epochs=2, batch_size=16, eval_every=1)
    train_model(
        model,
        data.train[:32],
        tcfg,
        pad_id=PAD,
        seed=0,
        progress=False,
        track=lambda m: {"mem": 0.5},
        desc="tiny",
    )
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[tiny]")]
    assert [ln.split(" {")[0] for ln in lines] == ["[tiny] epoch 1/2", "[tiny] epoch 2/2"]
    assert "'mem': 0.5" in lines[-1]


def test_other_vector_instructions_train_under_another_key(monkeypatch):
    """Models trained where torch's kernels use other vector instructions than AVX2 (the
    committed tables') are other weights: the key gets a suffix; AVX2 keeps the keys the
    committed results name. A record that names other numerics is not loaded."""
    pre = get_preset("math_noise", "default")
    data = make_data(pre.data, 0)
    args = ("math_noise", "memorizing", 0, data.config, train._fill(pre.model, data), pre.train)
    committed = "math_noise-memorizing-e35-ce91f6c621e8dfe8"  # results/tinymem's
    monkeypatch.setattr(trained_on, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(trained_on.torch, "get_num_threads", lambda: 2)
    assert _key(*args) == committed
    assert trained_on.key_suffix("cuda") == "-cuda"  # a GPU's kernels: other weights again
    assert trained_on.trained_on()["device"] == "cpu"
    record = {"trained_on": {"device": "cpu", "cpu_capability": "AVX2"}}
    assert not trained_on.trained_elsewhere(record) and not trained_on.trained_elsewhere({})
    assert trained_on.trained_elsewhere(record, "cuda")
    assert not trained_on.trained_elsewhere({"trained_on": {**record["trained_on"], "threads": 2}})
    # another thread count: other weights, another key; a record from 1 thread is not loaded
    monkeypatch.setattr(trained_on.torch, "get_num_threads", lambda: 4)
    assert _key(*args) == committed + "-t4"
    assert trained_on.trained_elsewhere({"trained_on": {**record["trained_on"], "threads": 1}})
    monkeypatch.setattr(trained_on.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(trained_on, "cpu_capability", lambda: "AVX512")
    assert _key(*args) == committed + "-avx512"
    assert trained_on.trained_elsewhere(record)
    other = {"trained_on": {**record["trained_on"], "cpu": "Some Other CPU"}}
    assert trained_on.other_cpu(other) == "Some Other CPU" and trained_on.other_cpu({}) is None


def test_a_model_another_process_is_training_is_waited_for_not_trained_twice(tmp_path, monkeypatch):
    """While one process holds a model's lock (training it), another asking for the same model
    waits, and then trains only what is still missing: two test workers or two `gss bench`
    runs on one cache train each model once."""
    import threading

    from filelock import FileLock

    a, b = tmp_path / "a", tmp_path / "b"
    assert train._lock_path(a) == train._lock_path(a) != train._lock_path(b)
    held = train._lock_path(tmp_path / "held")
    monkeypatch.setattr(train, "_lock_path", lambda folder: held)  # every model: this lock
    got: dict = {}
    with FileLock(held):
        worker = threading.Thread(
            target=lambda: got.update(
                info=get_models("math_noise", TINY, seed=0, cache_dir=tmp_path, progress=False)[3]
            )
        )
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and not got  # blocked on the lock, nothing trained yet
        assert not any(tmp_path.iterdir())
    worker.join()
    assert not got["info"]["memorizing"]["loaded"]
    again = get_models("math_noise", TINY, seed=0, cache_dir=tmp_path, progress=False)[3]
    assert again["memorizing"]["loaded"] and again["reference"]["loaded"]
    assert not any(p.suffix == ".lock" for p in tmp_path.rglob("*"))  # locks live elsewhere
