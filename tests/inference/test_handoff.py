"""gss.reference_where_open: where some gate opens, the next token is the reference's.

Known by construction on tiny models: gates that always open give the reference's own greedy
text; gates that never open give the fine-tune's; in between, the tokens equal a cache-free
loop that asks, at each step, whether a gate opened at the last position and takes that
model's argmax. Left-padded batches give each row's own result, and the reference's cache
(read only where a gate opened) gives the same scores as reading everything again.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gss
from gss.errors import GSSError

from ..helpers import calibrated_llama, random_ids, tiny_model

NEW = 8


@pytest.fixture(scope="module")
def setup():
    model, art = calibrated_llama()
    reference = tiny_model("llama", seed=11)
    for m in (model, reference):  # every step generated: no end-of-sequence token
        m.generation_config.eos_token_id = None
    return model, art, reference


def _with_thresholds(art, value: float):
    return dataclasses.replace(art, thresholds=torch.full_like(art.thresholds, value))


def _greedy(model, ids, mask=None, processors=(), **options):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids) if mask is None else mask,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            logits_processor=list(processors),
            **options,
        )
    return out[:, ids.shape[1] :].tolist()


def _handed(model, art, reference, ids, mask=None):
    """The definition's form: every open gate hands over, the steer attached as it is."""
    with gss.reference_where_open(
        model,
        art,
        reference,
        min_signal=None,
        min_confidence=None,
        no_repeat_ngram=None,
        correct=True,
    ) as processor:
        return _greedy(model, ids, mask, [processor]), processor


def _opened_at_last(model, art, ids) -> bool:
    """Whether some gate opens at the last position of ``ids`` (gss.explain's evidence)."""
    return gss.explain(model, art, ids, max_new_tokens=1).tokens[len(ids) - 1].steered


def _reference_loop(model, art, reference, prompt):
    ids = list(prompt)
    for _ in range(NEW):
        x = torch.tensor([ids])
        if _opened_at_last(model, art, ids):
            with torch.no_grad():
                logits = reference(input_ids=x).logits[0, -1]
        else:
            with art.attach(model), torch.no_grad():
                logits = model(input_ids=x).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_always_open_says_what_the_reference_says(setup):
    model, art, reference = setup
    ids = random_ids(3, 6, seed=5)
    handed, processor = _handed(model, _with_thresholds(art, 1e-30), reference, ids)
    assert handed == _greedy(reference, ids)
    assert processor.handed_share == 1.0


def test_never_open_says_what_the_fine_tune_says(setup):
    model, art, reference = setup
    ids = random_ids(3, 6, seed=5)
    handed, processor = _handed(model, _with_thresholds(art, 1e30), reference, ids)
    assert handed == _greedy(model, ids)
    assert processor.handed == 0


def test_between_equals_the_cache_free_definition(setup):
    model, art, reference = setup
    handed_any = False
    for seed in range(4):
        prompt = random_ids(1, 6, seed=20 + seed)[0].tolist()
        handed, processor = _handed(model, art, reference, torch.tensor([prompt]))
        assert handed[0] == _reference_loop(model, art, reference, prompt)
        handed_any |= 0 < processor.handed < processor.steps
    assert handed_any, "the fixture's gates should open on some steps and not others"


def test_left_padded_batch_gives_each_row_its_own(setup):
    model, art, reference = setup
    prompts = [random_ids(1, 7, seed=30)[0].tolist(), random_ids(1, 4, seed=31)[0].tolist()]
    alone = [_handed(model, art, reference, torch.tensor([p]))[0][0] for p in prompts]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched, _ = _handed(model, art, reference, ids, mask)
    assert batched == alone


def test_steer_comes_off_and_bad_references_are_refused(setup):
    model, art, reference = setup
    ids = random_ids(1, 6, seed=5)
    plain = _greedy(model, ids)
    _handed(model, art, reference, ids)
    assert _greedy(model, ids) == plain  # nothing left attached
    with (
        pytest.raises(GSSError, match="must be a model"),
        gss.reference_where_open(model, art, "gpt2"),
    ):
        pass
    with (
        pytest.raises(GSSError, match="SteeringArtifact"),
        gss.reference_where_open(model, "steer/", reference),
    ):
        pass


def test_a_lora_fine_tune_hands_off_to_its_own_base():
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", seed=3)
    reference = tiny_model("llama", seed=3)  # the same weights, a second copy
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    tuned = peft.get_peft_model(base, config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    for m in (tuned, reference):
        m.generation_config.eos_token_id = None
    art = gss.calibrate(
        tuned, reference, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False
    )
    ids = random_ids(2, 6, seed=5)
    always = _with_thresholds(art, 1e-30)
    own_base, _ = _handed(tuned, always, gss.adapters_off(tuned), ids)
    assert own_base == _greedy(reference, ids) != _greedy(tuned, ids)


def test_gss_generate_says_the_references_text_where_gates_open(tmp_path, capsys):
    from gss.cli import main

    from ..helpers import word_tokenizer

    tokenizer = word_tokenizer()
    for name, seed in (("model", 3), ("reference", 11)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    model = tiny_model("llama", seed=3)
    reference = tiny_model("llama", seed=11)
    art = gss.calibrate(
        model, reference, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False
    )
    _with_thresholds(art, 1e-30).save_pretrained(tmp_path / "steer")
    prompt = "w1 w2 w3 w4"
    args = [
        "generate",
        "--model",
        str(tmp_path / "model"),
        "--steer",
        str(tmp_path / "steer"),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "6",
    ]
    assert main([*args, "--reference-where-open", str(tmp_path / "reference")]) == 0
    printed = capsys.readouterr().out
    enc = tokenizer(prompt, return_tensors="pt")
    # what the library's defaults say (min_signal 1 nat, no correction elsewhere)
    always = _with_thresholds(art, 1e-30)
    with gss.reference_where_open(model, always, reference) as p, torch.no_grad():
        ids = model.generate(
            **enc, max_new_tokens=6, do_sample=False, pad_token_id=0, logits_processor=[p]
        )
    said = tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert f"steered:   {said}\n" in printed
    assert f"the reference chose the token, at {100 * p.handed_share:.1f}% of" in printed
    code = main([*args, "--reference-where-open", str(tmp_path / "reference"), "--explain"])
    assert code == 2 and "give one of them" in capsys.readouterr().err
    # --min-signal / --min-confidence: the library's; refused without --reference-where-open
    handed = [*args, "--reference-where-open", str(tmp_path / "reference")]
    said_by = set()
    for cut, sure in (("-1e9", "0"), ("1e9", "0"), ("-1e9", "0.95"), ("-1e9", "1e-9")):
        assert main([*handed, "--min-signal", cut, "--min-confidence", sure]) == 0
        handing = gss.reference_where_open(
            model, always, reference, min_signal=float(cut), min_confidence=float(sure)
        )
        with handing as p, torch.no_grad():
            ids = model.generate(
                **enc, max_new_tokens=6, do_sample=False, pad_token_id=0, logits_processor=[p]
            )
        said = tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        assert f"steered:   {said}\n" in capsys.readouterr().out
        said_by.add((said, p.handed))
    assert len(said_by) >= 2, "the flags change what is said"
    assert main([*args, "--min-signal", "2"]) == 2
    assert "give --reference-where-open REF too" in capsys.readouterr().err
    assert main([*handed, "--min-signal", "nan"]) == 2
    assert "finite number of nats" in capsys.readouterr().err
    assert main([*args, "--min-confidence", "0.5"]) == 2
    assert "give --reference-where-open REF too" in capsys.readouterr().err
    assert main([*handed, "--min-confidence", "1.5"]) == 2
    assert "probability in [0, 1]" in capsys.readouterr().err
    # --no-repeat-ngram: the library's guard on the reference's steps
    for size in ("0", "2"):
        flags = ["--min-signal", "-1e9", "--min-confidence", "0", "--no-repeat-ngram", size]
        assert main([*handed, *flags]) == 0
        handing = gss.reference_where_open(
            model, always, reference, min_signal=-1e9, min_confidence=0, no_repeat_ngram=int(size)
        )
        with handing as p, torch.no_grad():
            ids = model.generate(
                **enc, max_new_tokens=6, do_sample=False, pad_token_id=0, logits_processor=[p]
            )
        said = tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        assert f"steered:   {said}\n" in capsys.readouterr().out
    assert main([*args, "--no-repeat-ngram", "3"]) == 2
    assert "give --reference-where-open REF too" in capsys.readouterr().err
    assert main([*handed, "--no-repeat-ngram", "-1"]) == 2
    assert "0 (off) or more" in capsys.readouterr().err
    # --handoff-gates none: any step, the signal alone deciding (`steer=None`), even where the
    # steer's gates never open; with them (the default) such a steer hands nothing over
    _with_thresholds(art, 1e30).save_pretrained(tmp_path / "closed")
    closed = [*handed, "--steer", str(tmp_path / "closed"), "--min-signal", "-1e9"]
    closed += ["--min-confidence", "0"]
    outputs = {}
    for gates in ("steer", "none"):
        assert main([*closed, "--handoff-gates", gates]) == 0
        outputs[gates] = capsys.readouterr().out
    bare = gss.reference_where_open(model, None, reference, min_signal=-1e9, min_confidence=0)
    with bare as p, torch.no_grad():
        ids = model.generate(
            **enc, max_new_tokens=6, do_sample=False, pad_token_id=0, logits_processor=[p]
        )
    said = tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert f"steered:   {said}\n" in outputs["none"] and p.handed > 0
    assert "at 0.0% of" in outputs["steer"] and f"steered:   {said}\n" not in outputs["steer"]
    assert "at any step)" in outputs["none"] and "where a gate opened)" in outputs["steer"]
    # no flag: the rule gss protect chose for this steer (its record), else the gates
    assert main(closed) == 0 and capsys.readouterr().out == outputs["steer"]
    record = {"protect": {"handoff": {"gates": "none"}}}
    chosen = _with_thresholds(art, 1e30)
    chosen = dataclasses.replace(
        chosen, provenance=dataclasses.replace(chosen.provenance, extra=record)
    )
    chosen.save_pretrained(tmp_path / "chosen")
    recorded = [*closed, "--steer", str(tmp_path / "chosen")]
    assert main(recorded) == 0 and capsys.readouterr().out == outputs["none"]
    assert main([*recorded, "--handoff-gates", "steer"]) == 0
    assert capsys.readouterr().out == outputs["steer"]  # a flag given wins
    assert main([*args, "--handoff-gates", "none"]) == 2
    assert "give --reference-where-open REF too" in capsys.readouterr().err


def test_a_row_enters_at_a_gate_and_a_sure_choice_and_then_needs_no_gate(setup):
    """The rule, call by call: a row enters where a gate opens and the fine-tune is sure; once
    in, its steps are handed over gate or not; a new generation starts with no row in; an
    unsure choice at an open gate, or a sure one at a closed gate, does not enter."""
    from types import SimpleNamespace

    from gss.inference.handoff import ReferenceWhereOpen

    _, _, reference = setup
    gate = SimpleNamespace(last=None)
    processor = ReferenceWhereOpen(reference, [gate], None, 0.9)  # type: ignore[list-item]
    sure = torch.full((2, 32), -10.0)
    sure[:, 3] = 10.0  # the fine-tune near-certain of token 3
    unsure = torch.zeros(2, 32)
    unsure[:, 3] = 0.1  # token 3 first, at about 1/32
    ids = random_ids(2, 5, seed=3)

    def step(ids, scores, opened):
        gate.last = torch.tensor(opened)
        out = processor(ids, scores.clone())
        return [not torch.equal(out[i], scores[i]) for i in range(2)]

    assert step(ids, unsure, [True, False]) == [False, False]  # open but unsure
    assert step(torch.cat([ids, ids[:, :1]], 1), sure, [False, True]) == [False, True]
    assert processor.entered.tolist() == [False, True]
    longer = torch.cat([ids, ids[:, :2]], 1)  # the same generation, one step on
    assert step(longer, unsure, [False, False]) == [False, True]  # row 1 is in: no gate needed
    assert step(random_ids(2, 5, seed=4), unsure, [False, False]) == [False, False]  # new one
    assert processor.entered.tolist() == [False, False]


def test_min_confidence_hands_over_only_where_the_fine_tune_is_sure(setup):
    """With ``min_confidence``, a row's first hand-over needs the fine-tune to give its own
    choice at least that probability; from then on every step is handed over (no signal cut
    here): the definition, step by step, with gates that always open."""
    model, art, reference = setup
    always = _with_thresholds(art, 1e-30)
    for seed in range(40, 60):  # a prompt whose path is not surest at its first step
        prompt = random_ids(1, 6, seed=seed)[0].tolist()
        sure, path = [], list(prompt)
        with always.attach(model), torch.no_grad():  # the steered fine-tune's own path
            for _ in range(NEW):
                probs = model(input_ids=torch.tensor([path])).logits[0, -1].softmax(-1)
                sure.append(float(probs.max()))
                path.append(int(probs.argmax()))
        if sure[0] < max(sure[1:-1]):
            break
    cut = min(p for p in sure[1:-1] if p > sure[0])  # the first sure step: after the first
    first = next(j for j, p in enumerate(sure) if p >= cut)
    with torch.no_grad():  # from it on, the reference's own greedy text
        tail = reference.generate(
            input_ids=torch.tensor([path[: len(prompt) + first]]),
            attention_mask=torch.ones(1, len(prompt) + first, dtype=torch.long),
            max_new_tokens=NEW - first,
            do_sample=False,
            pad_token_id=0,
        )[0].tolist()
    ids = torch.tensor([prompt])
    with gss.reference_where_open(
        model, always, reference, min_signal=None, min_confidence=cut, correct=True
    ) as processor:
        assert _greedy(model, ids, None, [processor])[0] == tail[len(prompt) :]
        assert processor.handed == NEW - first
        # a second generation starts again: no row handed over yet
        assert _greedy(model, ids, None, [processor])[0] == tail[len(prompt) :]
    assert 0 < first < NEW - 1, "both kinds of steps"
    for bad in (1.5, -0.1, float("nan"), True):
        with (
            pytest.raises(GSSError, match="min_confidence must be a probability"),
            gss.reference_where_open(model, always, reference, min_confidence=bad),
        ):
            pass


def test_min_signal_hands_over_only_where_the_fine_tunes_choice_is_memorized(setup):
    """With ``min_signal``, an open gate hands the step over only where the fine-tune's own
    choice is that many nats likelier under it than under the reference: the definition,
    step by step, with gates that always open."""
    model, art, reference = setup
    always = _with_thresholds(art, 1e-30)
    prompt = random_ids(1, 6, seed=41)[0].tolist()
    ids = torch.tensor([prompt])
    with always.attach(model):  # never handed over: the steered fine-tune's own
        steered = _greedy(model, ids)
    assert _handed_with(model, always, reference, ids, 1e9)[0] == steered
    assert _handed_with(model, always, reference, ids, -1e9)[0] == _greedy(reference, ids)
    signals = []
    for cut in (0.3, 0.5):
        out, processor = _handed_with(model, always, reference, ids, cut)
        expected, steps = list(prompt), []
        for _ in range(NEW):
            x = torch.tensor([expected])
            with always.attach(model), torch.no_grad():
                mine = model(input_ids=x).logits[0, -1].log_softmax(-1)
            with torch.no_grad():
                theirs = reference(input_ids=x).logits[0, -1].log_softmax(-1)
            top = int(mine.argmax())
            signal = float(mine[top] - theirs[top])
            steps.append(signal > cut)
            signals.append(signal)
            expected.append(int(theirs.argmax()) if signal > cut else top)
        assert out[0] == expected[len(prompt) :]
        assert processor.handed == sum(steps)
    assert min(signals) < 0.3 < 0.5 < max(signals), "both kinds of steps, at each cut"
    with pytest.raises(GSSError, match="min_signal must be a finite number"):
        _handed_with(model, always, reference, ids, float("nan"))


def _handed_with(model, art, reference, ids, min_signal):
    with gss.reference_where_open(
        model, art, reference, min_signal=min_signal, min_confidence=None, correct=True
    ) as processor:
        return _greedy(model, ids, None, [processor]), processor


def test_without_the_correction_every_other_token_is_the_unsteered_fine_tunes(setup):
    """``correct=False``: the gates only choose where the reference speaks; with gates that
    never open the text is the unsteered fine-tune's, with gates that always open the
    reference's."""
    model, art, reference = setup
    ids = random_ids(2, 6, seed=7)
    with gss.reference_where_open(
        model,
        _with_thresholds(art, 1e30),
        reference,
        min_signal=None,
        min_confidence=0,
        correct=False,
    ) as processor:
        assert _greedy(model, ids, None, [processor]) == _greedy(model, ids)
    with gss.reference_where_open(
        model,
        _with_thresholds(art, 1e-30),
        reference,
        min_signal=None,
        min_confidence=0,
        correct=False,
    ) as processor:
        assert _greedy(model, ids, None, [processor]) == _greedy(reference, ids)


def test_the_defaults_are_the_measured_ones():
    import inspect

    defaults = inspect.signature(gss.reference_where_open).parameters
    assert defaults["min_signal"].default == 1.0 and defaults["correct"].default is False
    assert defaults["min_confidence"].default == 0.98
    assert defaults["no_repeat_ngram"].default == 6


def test_the_references_steps_repeat_no_ngram(setup):
    """Gates that always open with ``no_repeat_ngram=n`` give the reference's greedy text under
    transformers' own ``no_repeat_ngram_size=n``; gates that never open leave the fine-tune's
    text (loops and all); a bad value is refused."""
    model, art, reference = setup
    ids = random_ids(3, 6, seed=5)
    loops = _greedy(reference, ids)
    for n in (2, 3):
        with gss.reference_where_open(
            model,
            _with_thresholds(art, 1e-30),
            reference,
            min_signal=None,
            min_confidence=None,
            no_repeat_ngram=n,
        ) as processor:
            guarded = _greedy(model, ids, None, [processor])
        assert guarded == _greedy(reference, ids, no_repeat_ngram_size=n)
        if n == 2:
            assert guarded != loops, "the reference's own text should repeat some 2-gram"
    with gss.reference_where_open(
        model, _with_thresholds(art, 1e30), reference, min_signal=None, no_repeat_ngram=2
    ) as processor:
        assert _greedy(model, ids, None, [processor]) == _greedy(model, ids)
    for bad in (-1, 2.5, True):
        with (
            pytest.raises(GSSError, match="no_repeat_ngram must be"),
            gss.reference_where_open(model, art, reference, no_repeat_ngram=bad),
        ):
            pass


def test_without_a_steer_the_signal_alone_decides(setup):
    """``steer=None``: every step is open, so the text equals gates that always open (no
    correction) at the same ``min_signal``; without a signal it is refused."""
    model, art, reference = setup
    ids = random_ids(2, 6, seed=9)
    for cut in (-1e9, 0.5, 1e9):
        with gss.reference_where_open(
            model,
            _with_thresholds(art, 1e-30),
            reference,
            min_signal=cut,
            min_confidence=None,
            correct=False,
        ) as gated:
            expected = _greedy(model, ids, None, [gated])
        with gss.reference_where_open(
            model, None, reference, min_signal=cut, min_confidence=None
        ) as bare:
            assert _greedy(model, ids, None, [bare]) == expected
            assert bare.handed == gated.handed and bare.steps == gated.steps
    with (
        pytest.raises(GSSError, match="needs min_signal"),
        gss.reference_where_open(model, None, reference, min_signal=None),
    ):
        pass


def test_the_guard_holds_on_the_references_steps_only(setup):
    """A step the signal leaves to the fine-tune keeps its scores, loops and all, even in a row
    the reference has spoken for; a step the reference decides completes no repeated n-gram."""
    from gss.inference.handoff import ReferenceWhereOpen

    _, _, reference = setup
    ids = torch.tensor([[5, 6, 7, 5], [5, 6, 7, 5]])
    scores = torch.full((2, reference.config.vocab_size), -10.0)
    scores[:, 6] = 10.0  # both rows would say "5 6" again
    for cut, handed in ((1e9, 0), (-1e9, 2)):
        processor = ReferenceWhereOpen(
            reference, None, min_signal=cut, min_confidence=0.5, no_repeat_ngram=2
        )
        processor._ids, processor.entered = ids[:, :3], torch.tensor([True, False])
        out = processor(ids, scores)
        assert processor.handed == handed
        if handed:
            assert (out[:, 6] == float("-inf")).all()
        else:
            assert torch.equal(out, scores)
