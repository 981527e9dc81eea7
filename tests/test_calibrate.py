import warnings

import pytest
import torch

import gss
from gss import solve_probe_steer
from gss.solve.thresholds import probe_responses

from .helpers import random_ids


def _direct_statistics(model, ref, ids, layer):
    """M and Sigma_gen computed in one shot with transformers' own hidden states."""
    params = [p.requires_grad for p in model.parameters()]
    out = model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[layer + 1]  # output of block `layer`
    hidden.retain_grad()
    logp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    with torch.no_grad():
        ref_logp = torch.log_softmax(ref(input_ids=ids).logits[:, :-1], -1)
        ref_logp = ref_logp.gather(-1, ids[:, 1:, None])[..., 0]
    mem = (logp.detach() - ref_logp) > 0
    (logp * mem).sum().backward()
    h, g = hidden.detach()[:, :-1].double(), hidden.grad[:, :-1].double()
    M = h[mem].T @ g[mem] / int(mem.sum())
    sigma = torch.cov(h[~mem].T, correction=0)
    model.zero_grad()
    assert [p.requires_grad for p in model.parameters()] == params
    return M, sigma, h[~mem]


def test_matches_a_direct_computation(make_model):
    model, ref = make_model("gpt2", seed=0), make_model("gpt2", seed=1)
    ids = random_ids(16, 12)
    # the paper's M (the log-likelihood gradient), computed directly below
    art = gss.calibrate(
        model, ref, ids, "gss", layer=0, rank=3, delta=2.0, batch_size=5, progress=False
    )
    M, sigma, h_gen = _direct_statistics(model, ref, ids, layer=0)
    sol = solve_probe_steer(M, sigma, 3, 2.0)
    assert torch.allclose(art.probe.double(), sol.probe, atol=1e-4, rtol=1e-4)
    assert torch.allclose(art.steer.double(), sol.steer, atol=1e-4)
    responses = (h_gen @ sol.probe.T).abs()
    assert torch.allclose(
        art.thresholds.double(), torch.quantile(responses, 0.95, dim=0), rtol=1e-4
    )
    counts = art.provenance.token_counts
    assert counts["tokens"] == 16 * 11 and counts["memorized"] + counts["general"] == 16 * 11
    assert set(art.provenance.timings) >= {"signal", "statistics", "solve", "thresholds", "total"}
    assert not model.training and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_callers_no_grad_does_not_reach_the_gradients(make_model, mode):
    """Inference code often runs under no_grad: M's gradients are taken all the same."""
    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    ids = random_ids(12, 10)
    expected = gss.calibrate(model, ref, ids, layer=0, rank=2, progress=False)
    with mode():
        art = gss.calibrate(model, ref, ids, layer=0, rank=2, progress=False)
        scan = gss.scan_layers(model, ref, ids, rank=2, progress=False)
    assert torch.equal(art.probe, expected.probe) and torch.equal(art.steer, expected.steer)
    assert len(scan.strengths) == 2
    with gss.steer(model, art):  # usable outside the caller's mode
        model(ids[:2]).logits.sum().backward()


def test_gate_share_sets_the_union_open_share(make_model):
    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    art = gss.calibrate(
        model, ref, random_ids(30, 16), layer=0, rank=4, gate_share=0.1, progress=False
    )
    share = art.provenance.gate_open_share
    assert share["union"] == pytest.approx(0.1, abs=0.02)
    assert art.provenance.threshold_rule["kind"] == "gate_share"


def test_quantile_rule_marks_that_share(make_model):
    model, ref = make_model("gpt2", seed=0), make_model("gpt2", seed=1)
    art = gss.calibrate(
        model, ref, random_ids(20, 16), layer=1, rank=2, memorized_quantile=0.1, progress=False
    )
    assert art.provenance.token_counts["memorized_share"] == pytest.approx(0.1, abs=0.01)
    assert art.provenance.memorized_rule["kind"] == "quantile"


@pytest.mark.parametrize("centering", ["covariance", "full", "none"])
def test_each_centering_meets_its_own_budget(make_model, centering):
    """Over the general tokens: var(s) = delta (covariance), E[s^2] = delta (full, none)."""
    model, ref = make_model("gpt2", seed=0), make_model("gpt2", seed=1)
    held_out = random_ids(24, 16, seed=8)
    delta = 0.5
    art = gss.calibrate(
        model,
        ref,
        random_ids(16, 16),
        layer=0,
        rank=2,
        delta=delta,
        gen_texts=held_out,
        centering=centering,
        jitter=1e-9,
        progress=False,
    )
    assert art.provenance.memorized_rule["sigma_from"] == "gen_texts"
    # describe() calls the calibration tokens left unmarked what they are, apart from the
    # held-out tokens Sigma_gen rests on (24 x 15 of them)
    text = art.describe()
    assert "not memorized (Sigma_gen: the held-out general text's tokens, below)" in text
    assert "statistics: 360 general tokens" in text
    s = probe_responses(model, art, held_out).double()
    measured = s.var(0, correction=0) if centering == "covariance" else (s**2).mean(0)
    assert torch.allclose(measured, torch.full((2,), delta, dtype=torch.float64), rtol=1e-3)


@pytest.mark.parametrize("separate_general", [False, True])
def test_thresholds_from_kept_hidden_states_equal_a_second_pass(make_model, separate_general):
    from gss.calibrate import build_artifact
    from gss.statistics.collect import collect_statistics

    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    ids = random_ids(12, 10)
    gen = random_ids(9, 8, seed=5) if separate_general else None
    arts = {}
    for keep in (None, 0):  # default keeps them; 0 forces the second pass
        stats = collect_statistics(
            model, ref, ids, layer=1, gen_texts=gen, batch_size=4, keep_general=keep, progress=False
        )
        assert (stats.general_sample is None) == (keep == 0)
        arts[keep] = build_artifact(model, stats, rank=2, progress=False)
    kept, passed = arts[None], arts[0]
    assert kept.provenance.token_counts["threshold_pass"] is False
    assert passed.provenance.token_counts["threshold_pass"] is True
    assert (
        kept.provenance.token_counts["threshold_samples"]
        == passed.provenance.token_counts["threshold_samples"]
    )
    assert torch.allclose(kept.thresholds, passed.thresholds, rtol=1e-5, atol=1e-6)


def test_general_flags_give_back_each_batch_mask_for_ragged_sequences():
    from gss.data import batches
    from gss.hf.forward import target_mask
    from gss.statistics.collect import GeneralFlags

    lengths = [2, 7, 3, 9, 5, 5, 12, 4]
    seqs = [list(range(1, n + 1)) for n in lengths]
    flags = GeneralFlags(seqs)
    assert flags.flags.numel() == sum(n - 1 for n in lengths)
    generator = torch.Generator().manual_seed(0)
    written = []
    for batch in batches(seqs, 3):
        valid = target_mask(batch.attention_mask)
        general = valid & (torch.rand(valid.shape, generator=generator) > 0.5)
        flags.add(general, valid)
        written.append(general)
    for b, batch in enumerate(batches(seqs, 3)):
        assert torch.equal(flags.mask(b, target_mask(batch.attention_mask)), written[b])


def test_threshold_sample_is_capped(make_model):
    from gss.calibrate import build_artifact
    from gss.statistics.collect import collect_statistics

    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    stats = collect_statistics(model, ref, random_ids(12, 10), layer=1, progress=False)
    general = stats.counts["general"]
    assert general > 10
    art = build_artifact(model, stats, rank=2, max_threshold_samples=10, progress=False)
    assert art.provenance.token_counts["threshold_samples"] == 10
    full = build_artifact(model, stats, rank=2, progress=False)
    assert full.provenance.token_counts["threshold_samples"] == general


def test_compact_encoding_holds_the_same_ids_without_python_int_lists():
    from gss.data import encode, encode_compact

    ids = random_ids(5, 9)
    rows = encode_compact(ids, max_length=6)
    assert all(r.data_ptr() >= ids.data_ptr() for r in rows)  # views of the given tensor
    assert all(r.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr() for r in rows)
    assert [r.tolist() for r in rows] == encode(ids, max_length=6)

    class Chars:  # a stand-in tokenizer: one id per character
        def __call__(self, texts, **kwargs):
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

    texts = ["ab", "x", "hello", "", "wxyz"]
    compact = encode_compact(texts, Chars(), chunk=2)
    assert all(r.dtype == torch.int32 for r in compact)
    assert [r.tolist() for r in compact] == encode(texts, Chars())
    with pytest.raises(gss.GSSError, match="shorter than 2"):
        encode_compact(["a", "b", "c"], Chars(), chunk=2)


def test_calibrate_thresholds_resets_the_gates_and_records_their_new_open_shares(make_model):
    model, ref = make_model("llama"), make_model("llama", seed=1)
    art = gss.calibrate(model, ref, random_ids(16, 12), layer=1, rank=2, progress=False)
    heldout = random_ids(24, 12, seed=7)
    again = gss.calibrate_thresholds(model, art, heldout, threshold_percentile=80.0)
    responses = probe_responses(model, art, heldout).abs().double()
    assert torch.allclose(again.thresholds, torch.quantile(responses, 0.8, dim=0).float())
    shares = again.provenance.gate_open_share
    assert again.provenance.threshold_rule == {"kind": "percentile", "percentile": 80.0}
    assert shares["tokens"] == responses.shape[0] and shares != art.provenance.gate_open_share
    measured = (responses > again.thresholds.double()).double().mean(0)
    assert shares["per_direction"] == pytest.approx(measured.tolist())
    assert shares["per_direction"] == pytest.approx([0.2, 0.2], abs=0.01)
    assert f"any open on {100 * shares['union']:.1f}%" in again.describe()
    assert torch.equal(again.probe, art.probe) and torch.equal(again.steer, art.steer)
    # the card counts the responses the new gates were set on, not the calibration's
    assert again.provenance.token_counts["threshold_samples"] == responses.shape[0]
    assert art.provenance.token_counts["threshold_samples"] != responses.shape[0]
    # thresholds set by hand carry no open share (the calibration's would no longer hold), nor
    # a count of responses
    manual = art.with_thresholds(again.thresholds, {"kind": "manual"})
    assert manual.provenance.gate_open_share == {}
    assert "threshold_samples" not in manual.provenance.token_counts


def test_unsound_statistics_are_said_and_recorded(make_model):
    """Too few general tokens for the width, too few memorized ones for the rank: each is one
    GSSWarning with its remedy, recorded in the artifact and printed by describe()."""
    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    ids = random_ids(12, 12)
    sound = gss.calibrate(model, ref, ids, layer=1, rank=2, progress=False)
    assert sound.provenance.soundness["warnings"] == []
    facts = sound.provenance.soundness
    assert facts["dimension"] == 32 and facts["general_tokens"] >= 32
    with pytest.warns(gss.GSSWarning, match="general tokens for 32 dimensions") as seen:
        art = gss.calibrate(
            model, ref, ids, layer=1, rank=2, gen_texts=random_ids(2, 8, seed=3), progress=False
        )
    assert len([w for w in seen if "calibration:" in str(w.message)]) == 1
    assert any("rests on 14 general tokens" in p for p in art.provenance.soundness["warnings"])
    assert "WARNING: Sigma_gen rests on 14 general tokens" in art.describe()
    with pytest.warns(gss.GSSWarning, match="memorized tokens for 4 directions"):
        gss.calibrate(model, ref, random_ids(3, 6), layer=1, rank=4, progress=False)
    with pytest.raises(gss.GSSError, match=r"all but one of the .* marked memorized.*quantile"):
        gss.calibrate(model, ref, ids, layer=1, memorized_quantile=0.999, progress=False)
    share = r"9\d\.\d% of the calibration tokens were marked memorized and the rest"
    with pytest.warns(gss.GSSWarning, match=share):
        gss.calibrate(model, ref, ids, layer=1, rank=2, memorized_quantile=0.95, progress=False)
    # with held-out general text, an all-memorized calibration set is the usual set-up
    with warnings.catch_warnings():
        warnings.simplefilter("error", gss.GSSWarning)
        gen = random_ids(12, 12, seed=5)
        gss.calibrate(
            model, ref, ids, layer=1, rank=2, omega_threshold=-1e9, gen_texts=gen, progress=False
        )
