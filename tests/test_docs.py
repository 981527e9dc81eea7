"""docs/your-model.md's Python example runs as written (on tiny local models standing in for
the user's fine-tune and its base)."""

import re
from pathlib import Path

from .conftest import tiny_model
from .test_cli import _tokenizer

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "your-model.md"


def test_your_model_python_example_runs(tmp_path, monkeypatch, capsys):
    section = GUIDE.read_text().split("## In Python", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    for name, seed in (("ft", 0), ("base", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        _tokenizer().save_pretrained(tmp_path / name)

    def lines(offset: int) -> str:  # rows longer than k = 32 tokens, so they can be prompted
        rows = [" ".join(f"w{(i * 7 + j * offset) % 40}" for j in range(40)) for i in range(12)]
        return "\n".join(rows) + "\n"

    (tmp_path / "candidates.txt").write_text(lines(3))
    (tmp_path / "heldout.txt").write_text(lines(5))
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "your-model.md", "exec"), {})
    assert (tmp_path / "gss-artifact" / "gss_config.json").is_file()
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) >= 2, printed  # before/after, then at least one point of the front
