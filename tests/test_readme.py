"""The README's Python example runs as written (on tiny local models standing in for yours)."""

import re
from pathlib import Path

from .conftest import tiny_model
from .test_cli import _tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    for name, seed in (("finetuned-model", 0), ("base-model", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        _tokenizer().save_pretrained(tmp_path / name)
    lines = [" ".join(f"w{(i * 5 + j) % 40}" for j in range(10)) for i in range(16)]
    (tmp_path / "finetune_data.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "README.md", "exec"), {})
    assert (tmp_path / "gss-artifact" / "gss_config.json").is_file()
    assert capsys.readouterr().out.strip()
