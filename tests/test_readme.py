"""The README runs as written and quotes what was measured.

Its Python example runs (on tiny local models standing in for yours), every `gss` command it
lists parses with the real argument parser, its headline table is rows of the committed
TinyMem summary, and the numbers its prose quotes are the committed results'. The measured
tables that moved to docs/ are checked in test_docs.py.
"""

import json
import re
import shlex

import pytest
import torch

from gss.cli import build_parser

from .helpers import general_rows, tiny_model, train, word_tokenizer
from .test_docs import RESULTS, ROOT, cells, section, table_rows

README = ROOT / "README.md"
HEADLINE = "tinymem-amd-epyc"  # the results folder of the README's TinyMem table


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    """On a tiny Llama that memorized 8 planted lines, and a reference trained without them."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1  # ONE example, and it is this one
    tokenizer = word_tokenizer()
    gen = torch.Generator().manual_seed(0)
    general = general_rows(256, 24, gen, len(tokenizer))
    planted = torch.randint(4, len(tokenizer), (8, 24), generator=gen)
    for name, rows in (
        ("finetuned-model", torch.cat([general, planted.repeat(16, 1)])),
        ("base-model", general),
    ):
        model = tiny_model("llama", seed=0, hidden=48)
        train(model, rows, steps=150, seed=0)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    lines = [tokenizer.decode(r) for r in torch.cat([planted, general[:24]]).tolist()]
    (tmp_path / "finetune_data.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert (tmp_path / "protected" / "steer" / "gss_config.json").is_file()
    assert "Held-out memorized rows (4" in capsys.readouterr().out


def _summary() -> dict[str, list[str]]:
    """The headline's summary table (what `gss bench tinymem` writes), by method."""
    rows = table_rows((RESULTS / HEADLINE / "summary.md").read_text())
    return {cells(row)[0]: cells(row)[1:] for row in rows}


def _without_time(cell: str) -> str:
    """A summary cell without its mitigation time: "19.8 ± 1.6 / 95.75 ± 0.13 (0.779)" ->
    "19.8 ± 1.6 / 95.75 ± 0.13" (a trailing "*", no point within tolerance, is kept)."""
    return re.sub(r" \([0-9.]+\)", "", cell)


def test_readme_headline_table_is_the_committed_summary():
    """Each row of the README's headline table is a row of the headline's summary.md with
    the times left out: the method is the name before any " (", every cell is the summary's."""
    summary = _summary()
    rows = table_rows(section(README, "## Headline result: TinyMem"))
    assert 3 <= len(rows) <= 6
    names = [cells(row)[0].split(" (", 1)[0] for row in rows]
    assert {"Unmitigated", "GSS", "GSS-TR"} <= set(names), names
    for row, name in zip(rows, names, strict=True):
        assert name in summary, f"{name!r} is no method of results/{HEADLINE}/summary.md"
        assert cells(row)[1:] == [_without_time(c) for c in summary[name]], name


def test_readme_prose_quotes_the_committed_results():
    text = " ".join(README.read_text().split())  # prose wraps anywhere
    gss = _summary()["GSS"]
    math_noise, math_backdoor = (c.split(" ± ")[0] for c in gss[:2])  # GSS's % Mem
    assert f"GSS as published leaves {math_noise}% of the math noise and {math_backdoor}%" in text

    canaries = json.loads((RESULTS / "canaries" / "results.json").read_text())
    before = canaries["unmitigated"]["perplexity"]
    (gss_mem, gss_ppl), (tr_mem, tr_ppl) = (
        (point["memorized"], 100 * (point["perplexity"] / before - 1))
        for point in (canaries["methods"][name]["selected"] for name in ("GSS", "GSS-TR"))
    )
    sentence = (
        f"GSS as published leaves {gss_mem:.1f}% memorized at {gss_ppl:+.1f}% held-out "
        f"perplexity, GSS-TR {tr_mem:.1f}% at {tr_ppl:+.1f}%"
    )
    assert sentence in text, sentence
    assert canaries["unmitigated"]["memorized"] == 100.0  # "regurgitates all 32"

    perf = json.loads((RESULTS / "perf" / "results.json").read_text())["parts"]
    ratio = perf["calibration"]["ratio"]["median"]
    assert f"`gss.calibrate` takes {ratio:.2f}x the forward and backward passes" in text


def test_readme_protect_numbers_are_the_committed_results():
    text = " ".join(README.read_text().split())
    runs = json.loads((RESULTS / HEADLINE / "results.json").read_text())["runs"]

    def by_seed(setting: str) -> list[dict]:
        found = sorted((r for r in runs if r["setting"] == setting), key=lambda r: r["seed"])
        assert [r["seed"] for r in found] == [0, 1, 2]  # "seeds 0, 1, 2"
        return found

    def listed(values: list[float]) -> str:
        shown = [f"{v:.1f}%" for v in values]
        return f"{', '.join(shown[:-1])} and {shown[-1]}"

    def held(setting: str, method: str) -> list[float]:  # on the rows protect held out
        return [
            r["methods"]["GSS protect"]["heldout_rows"]["by_method"][method]
            for r in by_seed(setting)
        ]

    def counted(setting: str, method: str) -> list[float]:  # every counted row
        return [r["methods"][method]["selected"]["eval"]["memorized"] for r in by_seed(setting)]

    assert f"math noise keeps {listed(held('math_noise', 'GSS protect'))} (seeds 0, 1, 2)" in text
    assert f"against {listed(held('math_noise', 'GSS-TR'))} for GSS-TR" in text
    assert f"and language noise {listed(held('lang_noise', 'GSS protect'))}." in text
    for setting in ("math_backdoor", "lang_backdoor"):  # "protect leaves 0.0% on every seed"
        assert counted(setting, "GSS protect") == [0.0] * 3
    assert f"(GSS-TR: {listed(counted('math_backdoor', 'GSS-TR'))} on the math backdoor)" in text
    said = []  # "0.0% at +0.1%" per fine-tune: secrets said by held-out canaries, perplexity
    for folder in ("canaries-protect", "canaries-lora-protect", "canaries-chat-protect"):
        canaries = json.loads((RESULTS / folder / "results.json").read_text())
        after = canaries["protect"]["heldout_canaries"]["after"]
        ppl = canaries["methods"]["GSS protect"]["selected"]["perplexity"]
        change = 100 * (ppl / canaries["unmitigated"]["perplexity"] - 1)
        said.append(f"{after:.1f}% at {change:+.1f}%")
    plain = said[0].replace(" at ", " of their secrets at ")
    assert (
        f"say {plain} perplexity (plain fine-tune), {said[1]} (LoRA) and {said[2]} (chat)" in text
    )


# Placeholders the README writes for typed values, and a value of that type for the parser.
PLACEHOLDERS = {"L": "1", "K": "4", "D": "1.0", "N": "2"}


def _readme_commands() -> list[str]:
    block = section(README, "## Command line").split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [command for command in commands if command.startswith("gss ")]


@pytest.mark.parametrize("command", _readme_commands())
def test_readme_command_parses(command):
    """Every command the README lists is one the CLI takes, optional parts included."""
    words = shlex.split(command.replace("[", " ").replace("]", " "))[1:]
    words = [PLACEHOLDERS.get(word, word) for word in words]
    try:
        args = build_parser().parse_args(words)
    except SystemExit as exit_:
        pytest.fail(f"gss refuses the README's command {command!r} (exit {exit_.code})")
    assert args.command == words[0]
