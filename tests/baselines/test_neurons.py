"""TinyMem's neuron-level baselines: each ablates neurons that carry the memorized rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gss.errors import GSSError
from gss_bench.baselines import MitigationData, get_method, method_names
from gss_bench.baselines import neurons as nm
from gss_bench.baselines.mlp import mlp_layers, neuron_activations, zero_neurons
from gss_bench.baselines.training import edited_copy, mean_nll

from ..helpers import tiny_model
from .helpers import PAD, PROMPT, random_rows

METHODS = ("zero-out", "act", "slimming", "hard-concrete", "ig")
# Cheaper score settings than the defaults, for a fast suite. Hard concrete needs a weaker
# penalty to localize within a few steps on 6 rows (at lam 1000 its gates all close alike).
QUICK: dict[str, dict] = {
    "slimming": {"epochs": 3},
    "hard-concrete": {"epochs": 10, "lam": 10.0},
    "ig": {"steps": 5},
}
WIDTH = 128  # the tiny GPT-2's MLP: 4 x hidden 32


@pytest.fixture(autouse=True)
def _fresh_cache():
    nm.clear_score_cache()
    yield
    nm.clear_score_cache()


@pytest.fixture(scope="module")
def random_ablation_loss(memorizer_setup) -> float:
    """The highest memorized-set loss of 5 random ablations of 12 neurons per layer."""
    model, data = memorizer_setup
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(5):
        copy = edited_copy(model)
        for mlp in mlp_layers(copy):
            zero_neurons(mlp, torch.randperm(mlp.width, generator=gen)[:12])
        losses.append(mean_nll(copy, data.memorized, PAD, PROMPT))
    return max(losses)


def _llama_setup() -> tuple[torch.nn.Module, MitigationData]:
    model = tiny_model("llama", seed=3)
    rows = random_rows(4, 10, seed=5)
    return model, MitigationData(memorized=rows, clean=rows, pad_id=PAD, prompt_len=PROMPT)


def test_registered_as_neuron_family():
    assert set(METHODS) <= set(method_names("neuron"))
    for name in METHODS:
        method = get_method(name)
        assert method.family == "neuron"
        assert [p["ratio"] for p in method.grid][:1] == [0.001]  # mildest first
        # only zero-out's and IG's grids are cheaper than TinyMem's, and they say how
        assert bool(method.reduced_grid) == (name in ("zero-out", "ig"))
    assert {p["candidates"] for p in get_method("zero-out").grid} == {nm.ZERO_OUT_CANDIDATES}
    assert {p["max_positions"] for p in get_method("ig").grid} == {nm.IG_MAX_POSITIONS}


@pytest.mark.parametrize("name", METHODS)
def test_method_ablates_and_raises_memorized_loss(memorizer, random_ablation_loss, name):
    model, data = memorizer
    result = get_method(name).run(model, data, ratio=0.1, **QUICK.get(name, {}))
    edited = result.model
    assert type(edited) is type(model) and edited is not model
    before, after = model.state_dict(), edited.state_dict()
    assert {k: v.shape for k, v in before.items()} == {k: v.shape for k, v in after.items()}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".mlp." in k for k in changed), changed
    assert result.info["ablated"] == [12, 12]  # floor(128 * 0.1) per layer
    assert result.seconds > 0 and result.info["score_seconds"] > 0
    assert result.info["cached_score"] is False
    base = mean_nll(model, data.memorized, PAD, PROMPT)
    ablated = mean_nll(edited, data.memorized, PAD, PROMPT)
    assert ablated > max(random_ablation_loss, base + 0.05), (name, base, ablated)


@pytest.mark.parametrize(
    ("name", "score"), [("act", nm.activation_scores), ("zero-out", nm.zero_out_scores)]
)
def test_targeted_neurons_beat_the_least_scored(memorizer, name, score):
    """Ablating the top-scored neurons hurts U more than ablating the bottom-scored ones."""
    model, data = memorizer
    result = get_method(name).run(model, data, ratio=0.1)
    bottom = edited_copy(model)
    layers = mlp_layers(bottom)
    scores = score(bottom, layers, data)
    for mlp, chosen, layer_scores in zip(layers, result.info["neurons"], scores, strict=True):
        assert set(chosen) == set(torch.argsort(layer_scores, descending=True)[:12].tolist())
        zero_neurons(mlp, torch.argsort(layer_scores)[: len(chosen)])
    top_loss = mean_nll(result.model, data.memorized, PAD, PROMPT)
    bottom_loss = mean_nll(bottom, data.memorized, PAD, PROMPT)
    assert top_loss > bottom_loss + 0.05


def test_ablated_neurons_output_zero(memorizer):
    model, data = memorizer
    result = get_method("act").run(model, data, ratio=0.1)
    ids = torch.tensor(data.memorized)
    for mlp, chosen in zip(mlp_layers(result.model), result.info["neurons"], strict=True):
        store: list[torch.Tensor] = []
        with neuron_activations(mlp, store), torch.no_grad():
            result.model(input_ids=ids)
        acts = store[0]
        assert torch.count_nonzero(acts[..., chosen]) == 0
        kept = [i for i in range(WIDTH) if i not in chosen]
        assert torch.count_nonzero(acts[..., kept]) > 0


def test_larger_ratio_ablates_more(memorizer):
    model, data = memorizer
    method = get_method("act")
    small, large = method.run(model, data, ratio=0.05), method.run(model, data, ratio=0.2)
    assert small.info["ablated"] == [6, 6] and large.info["ablated"] == [25, 25]
    for few, many in zip(small.info["neurons"], large.info["neurons"], strict=True):
        assert set(few) < set(many)  # the same ranking, cut deeper
    assert large.info["cached_score"] is True
    assert large.info["reused_seconds"] == small.info["score_seconds"]
    for mlp in mlp_layers(large.model):
        silent = (mlp.up.weight == 0).all(dim=0)  # Conv1D: (in, out), a column per neuron
        assert int(silent.sum()) == 25


def test_tiny_ratio_ablates_one_neuron(memorizer):
    """TinyMem floors 0.001 * 128 to nothing; the intended smallest ablation is one neuron."""
    model, data = memorizer
    assert get_method("act").run(model, data, ratio=0.001).info["ablated"] == [1, 1]
    assert nm.neurons_to_ablate(512, 0.001) == 1
    assert nm.neurons_to_ablate(512, 0.01) == 5
    assert nm.neurons_to_ablate(512, 0.05) == 25


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_zero_out_replay_matches_zeroing_each_neuron(memorizer, arch):
    """The replayed forward gives the loss change of really zeroing each neuron, one by one."""
    model, data = memorizer if arch == "gpt2" else _llama_setup()
    copy = edited_copy(model)
    layers = mlp_layers(copy)
    report: dict = {}
    fast = nm.zero_out_scores(copy, layers, data, fast=True, report=report)
    assert report["replayed"] is True
    slow = nm.zero_out_scores(copy, layers, data, fast=False)
    base = mean_nll(copy, data.memorized, PAD, PROMPT)
    for layer, mlp in enumerate(layers):
        for neuron in (0, 7, mlp.width - 1):
            brute = edited_copy(copy)
            zero_neurons(mlp_layers(brute)[layer], torch.tensor([neuron]))
            delta = mean_nll(brute, data.memorized, PAD, PROMPT) - base
            assert fast[layer][neuron].item() == pytest.approx(delta, abs=2e-5)
        torch.testing.assert_close(fast[layer], slow[layer], atol=2e-5, rtol=1e-4)


def test_zero_out_falls_back_when_the_block_is_not_additive(memorizer):
    """A block that rescales its MLP output breaks the replay; the check catches it."""
    model, data = memorizer
    copy = edited_copy(model)
    for block in copy.transformer.h:
        block.mlp.register_forward_hook(lambda module, args, out: 2.0 * out)
    layers = mlp_layers(copy)
    report: dict = {}
    checked = nm.zero_out_scores(copy, layers, data, report=report)
    assert report["replayed"] is False
    plain = nm.zero_out_scores(copy, layers, data, fast=False)
    for got, want in zip(checked, plain, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_zero_out_candidates_are_exact_and_rank_first(memorizer):
    model, data = memorizer
    copy = edited_copy(model)
    layers = mlp_layers(copy)
    exact = nm.zero_out_scores(copy, layers, data)
    estimate = nm.zero_out_estimate(copy, layers, data)
    report: dict = {}
    mixed = nm.zero_out_scores(copy, layers, data, candidates=0.25, report=report)
    assert report["exact"] == [32, 32]
    for full, guess, got in zip(exact, estimate, mixed, strict=True):
        # the first-order estimate tracks the exact effect
        assert torch.corrcoef(torch.stack([full, guess]))[0, 1] > 0.5
        chosen = torch.argsort(guess, descending=True)[:32]
        rest = torch.ones(WIDTH, dtype=torch.bool)
        rest[chosen] = False
        torch.testing.assert_close(got[chosen], full[chosen])
        assert got[rest].max() < got[chosen].min()
        assert torch.equal(torch.argsort(got[rest]), torch.argsort(guess[rest]))
    with pytest.raises(GSSError, match="candidates"):
        get_method("zero-out").run(model, data, candidates=0)


def _ig_by_definition(model, layers, data, steps: int) -> list[torch.Tensor]:
    """The reference procedure: cut the row to t + 1 tokens, scale the last position by alpha."""
    alphas = torch.linspace(0, 1, steps)
    totals = [torch.zeros(m.width) for m in layers]
    for row in data.memorized:
        ids = torch.tensor(row)
        for layer, mlp in enumerate(layers):
            per_position = []
            for t in range(PROMPT - 1, len(row) - 1):
                seen = {}

                def hook(module, args, seen=seen):
                    acts = args[0].detach().clone()
                    seen["a"] = acts[0, -1].clone()
                    z = (seen["a"] * alphas[:, None]).requires_grad_(True)
                    seen["z"] = z
                    acts[:, -1] = z
                    return (acts,)

                handle = mlp.down.register_forward_pre_hook(hook)
                try:
                    logits = model(input_ids=ids[: t + 1].expand(steps, -1)).logits[:, -1]
                    prob = torch.softmax(logits, -1)[:, row[t + 1]].sum()
                    (grad,) = torch.autograd.grad(prob, seen["z"])
                finally:
                    handle.remove()
                per_position.append(seen["a"] * grad.mean(0))
            totals[layer] += torch.stack(per_position).mean(0)
    return [t / len(data.memorized) for t in totals]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_ig_matches_the_cut_input_definition(memorizer, arch):
    model, data = memorizer if arch == "gpt2" else _llama_setup()
    data = MitigationData(memorized=data.memorized[:2], clean=(), pad_id=PAD, prompt_len=PROMPT)
    copy = edited_copy(model)
    layers = mlp_layers(copy)
    fast = nm.integrated_gradient_scores(copy, layers, data, steps=4)
    reference = _ig_by_definition(copy, layers, data, steps=4)
    for got, want in zip(fast, reference, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-3)


def test_ig_position_sample_is_fixed_and_capped(memorizer):
    """A cap below the positions available scores exactly that many, the same ones every call;
    a cap above them scores everything (the sample is the full set)."""
    _, data = memorizer
    every = nm._ig_positions(data, None)
    total = sum(len(p) for _, p in every)
    sample = nm._ig_positions(data, total // 3)
    assert sum(len(p) for _, p in sample) == total // 3
    again = nm._ig_positions(data, total // 3)
    assert [p.tolist() for _, p in sample] == [p.tolist() for _, p in again]
    by_row = {id(row): set(p.tolist()) for row, p in every}
    assert all(set(p.tolist()) <= by_row[id(row)] for row, p in sample)
    whole = nm._ig_positions(data, total)
    assert [p.tolist() for _, p in whole] == [p.tolist() for _, p in every]


@pytest.mark.parametrize("name", ["slimming", "hard-concrete"])
def test_gate_training_resumes_like_a_fresh_run(memorizer, name):
    """A grid over epochs trains once; a resumed run equals one trained from scratch."""
    model, data = memorizer
    method = get_method(name)
    first = method.run(model, data, ratio=0.1, epochs=1)
    resumed = method.run(model, data, ratio=0.1, epochs=3)
    again = method.run(model, data, ratio=0.2, epochs=1)
    assert not first.info["cached_score"] and resumed.info["cached_score"]
    assert resumed.info["reused_seconds"] == pytest.approx(first.info["score_seconds"])
    assert resumed.info["score_seconds"] > first.info["score_seconds"]
    assert again.info["reused_seconds"] == again.info["score_seconds"]
    assert set(first.info["neurons"][0]) < set(again.info["neurons"][0])
    nm.clear_score_cache()
    fresh = method.run(model, data, ratio=0.1, epochs=3)
    assert fresh.info["neurons"] == resumed.info["neurons"]
    assert not fresh.info["cached_score"]


def test_cache_follows_the_model_weights(memorizer):
    model, data = memorizer
    method = get_method("act")
    method.run(model, data, ratio=0.1)
    assert method.run(model, data, ratio=0.1).info["cached_score"]
    other = edited_copy(model)  # same weights, another object: scored afresh
    assert not method.run(other, data, ratio=0.1).info["cached_score"]
    with torch.no_grad():
        mlp_layers(other)[0].up.weight.mul_(2.0)  # edited in place
    assert not method.run(other, data, ratio=0.1).info["cached_score"]


@pytest.mark.parametrize("name", METHODS)
def test_runs_on_a_gated_llama_mlp(name):
    model, data = _llama_setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = get_method(name).run(model, data, ratio=0.1, **QUICK.get(name, {}))
    assert type(result.model) is type(model)
    assert result.info["ablated"] == [6, 6]  # intermediate 64
    for mlp, chosen in zip(mlp_layers(result.model), result.info["neurons"], strict=True):
        assert (mlp.gate.weight[chosen] == 0).all() and (mlp.up.weight[chosen] == 0).all()
        assert (mlp.down.weight[:, chosen] == 0).all()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, "0.1", True])
def test_bad_ratio_is_a_gss_error(memorizer, ratio):
    model, data = memorizer
    with pytest.raises(GSSError, match="ratio"):
        get_method("act").run(model, data, ratio=ratio)


def test_bad_training_settings_are_gss_errors(memorizer):
    model, data = memorizer
    with pytest.raises(GSSError, match="epochs"):
        get_method("slimming").run(model, data, epochs=0)
    with pytest.raises(GSSError, match="lam"):
        get_method("hard-concrete").run(model, data, lam=-1.0)
    with pytest.raises(GSSError, match="steps"):
        get_method("ig").run(model, data, steps=0)


@pytest.mark.parametrize("name", METHODS)
def test_prompt_covering_the_rows_is_a_gss_error(memorizer, name):
    model, data = memorizer
    short = MitigationData(memorized=data.memorized, clean=(), pad_id=PAD, prompt_len=12)
    with pytest.raises(GSSError, match="after the prompt"):
        get_method(name).run(model, short, **QUICK.get(name, {}))


def test_zero_out_scores_a_fixed_sample_of_at_most_max_rows(memorizer):
    model, data = memorizer
    method = get_method("zero-out")
    n = len(data.memorized)
    whole = method.run(model, data, ratio=0.1, max_rows=n)  # not fewer rows than U: all of U
    full = method.run(model, data, ratio=0.1)
    assert whole.info["rows_scored"] == n == full.info["rows_scored"]
    for a, b in zip(whole.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b)
    cut = method.run(model, data, ratio=0.1, max_rows=2)
    again = method.run(model, dataclasses.replace(data), ratio=0.1, max_rows=2)
    assert cut.info["rows_scored"] == 2
    for a, b in zip(cut.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)  # the same sample every time
    with pytest.raises(GSSError, match="max_rows"):
        method.run(model, data, max_rows=0)
