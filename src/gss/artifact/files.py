"""Writing an artifact directory so that nothing is lost and nothing half-written ever loads.

Both files are written into a temporary directory beside the target and moved into place with
one rename, so an interrupted save leaves the old artifact (or nothing), never one artifact's
config beside another's tensors; the config records the tensors' SHA-256, so a pair that does
not belong together is refused when loaded. A directory is replaced only when it holds an
artifact and the caller asked to replace it; a directory with other files in it (a model's own
folder, say) is never written into. The artifact's model card (``README.md``, `gss.artifact.card`)
is replaced with it only while it is the card gss wrote, unedited: a README someone wrote or
edited beside an artifact is carried over into the new save, not overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from gss.artifact.card import card_is_generated
from gss.errors import GSSError, GSSWarning
from gss.file_names import ARTIFACT_FILES, CARD_NAME, CONFIG_NAME, STACK_NAME


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_creatable(path: Path, flag: str = "") -> None:
    """Refuse, before any work, a path that cannot be created: one under a file, or under a
    directory this process may not write in (else the error comes after the work, and the
    work is lost)."""
    name = f"{flag} {path}".strip()
    for parent in path.absolute().parents:
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise GSSError(f"{name} cannot be created: {parent} is a file, not a directory.")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise GSSError(f"{name} cannot be created: {parent} is not writable by this user.")
        try:  # what the OS says, also to root (a read-only or virtual file system: /proc)
            os.rmdir(tempfile.mkdtemp(prefix=".gss-check-", dir=parent))
        except OSError as err:
            raise GSSError(
                f"{name} cannot be created: {parent} takes no new directory ({err.strerror})."
            ) from None
        return


def holds_weights(directory: Path) -> bool:
    """Whether ``directory`` holds weight files (a model's or an artifact's), which must not
    be read as data nor have results written beside them."""
    return any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))


def through_link(path: Path, flag: str = "") -> Path:
    """``path``, or where it links to: a link to a directory is written through, as ``cp``
    would (a rename would replace the link and leave the old files where it pointed); a link
    to nothing is refused."""
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    if not target.exists():
        name = f"{flag} {path}".strip()
        raise GSSError(
            f"{name} is a link to {target}, which does not exist: create it, or give "
            "another directory."
        )
    return target


def check_target(directory: str | Path, overwrite: bool) -> Path:
    """Refuse a directory that saving an artifact would damage, before any work is done:
    one with files that are not an artifact's, or an artifact when ``overwrite`` is False."""
    if not isinstance(directory, (str, os.PathLike)):
        raise GSSError(f"give a directory path to save into, got {type(directory).__name__}.")
    if not str(directory):
        raise GSSError("the directory to save into is empty: give a path, e.g. ./artifact.")
    out = through_link(Path(directory))
    restore_interrupted(out)
    if out.exists() and not out.is_dir():
        raise GSSError(f"{out} is a file, not a directory: give a directory for the artifact.")
    if out.resolve() == Path.cwd().resolve():  # replaced by a rename: never the working dir
        raise GSSError(
            f"{directory} is the current directory: give the artifact a directory of its own, "
            "e.g. ./artifact."
        )
    inside = next((p for p in out.absolute().parents if _holds(p)), None)
    if inside is not None:  # it would travel with that folder when it is copied or uploaded
        raise GSSError(
            f"{out} is inside {inside}, which holds {_holds(inside)}: an artifact goes into a "
            "directory of its own. Choose one outside it."
        )
    if not out.is_dir():
        check_creatable(out)
        return out
    present = {p.name for p in out.iterdir()}
    if (out / CARD_NAME).is_symlink():  # kept across saves: a link would copy its target in
        raise GSSError(
            f"{out / CARD_NAME} is a link (to {os.readlink(out / CARD_NAME)}): a save keeps a "
            "README it did not write, and would copy the linked file into the artifact. "
            "Remove the link, or choose another directory."
        )
    ours = set(ARTIFACT_FILES)
    if STACK_NAME in present:
        ours = {STACK_NAME} | {p.name for p in out.glob("steer-*") if _is_artifact(p)}
    if CARD_NAME in present and (present & ours or card_is_generated(out / CARD_NAME)):
        ours.add(CARD_NAME)  # gss's card, or a README beside an artifact (kept: write_atomically)
    foreign = sorted(present - ours)
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise GSSError(
            f"{out} holds files that are not a gss artifact's ({shown}): gss writes an artifact "
            "only into a new or empty directory, or over an artifact. Choose another directory."
        )
    if present and not overwrite:
        raise GSSError(
            f"{out} already holds a gss artifact: pass overwrite=True (gss calibrate "
            "--overwrite) to replace it, or choose another directory."
        )
    return out


def interrupted_saves(out: Path) -> list[Path]:
    """The artifacts an overwrite of ``out`` set aside and was stopped before it put the new
    one in place (killed between its two renames: `write_atomically`)."""
    if not out.parent.is_dir():
        return []
    return [
        p / "artifact"
        for p in sorted(out.parent.glob(f".{out.name}.old-*"))
        if (p / "artifact").is_dir()
    ]


def restore_interrupted(out: Path) -> None:
    """Put back the artifact an interrupted overwrite left aside, where nothing took its
    place, and say so: a kill between the two renames must not lose it."""
    if out.exists() or out.is_symlink():
        return
    aside = interrupted_saves(out)
    if aside:
        aside[-1].rename(out)
        shutil.rmtree(aside[-1].parent, ignore_errors=True)
        warnings.warn(
            f"restored {out}: an earlier save over it was stopped between its two renames and "
            f"had set it aside in {aside[-1].parent.name}.",
            GSSWarning,
            stacklevel=3,
        )


def write_atomically(
    directory: str | Path,
    overwrite: bool,
    write: Callable[[Path], None],
    card: str | None = None,
) -> Path:
    """Call ``write(tmp)`` to fill a temporary directory, then put it at ``directory`` in one
    rename (after `check_target`); an existing artifact there is replaced only once the new one
    is complete. ``card``: the model card to write as ``README.md``, unless the directory holds
    a README gss did not write (or one edited since), which is kept instead."""
    out = check_target(directory, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old: Path | None = None
    try:
        write(tmp)
        _place_card(out, tmp, card)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a directory as mkdir would
        for path in tmp.rglob("*"):  # every file alike, as open() would
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())
        if out.is_dir():
            if any(out.iterdir()):
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                out.rename(old / "artifact")
            else:
                out.rmdir()
        tmp.rename(out)
    finally:
        if old is not None and not out.exists():  # stopped between the renames: put it back
            (old / "artifact").rename(out)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


WRITTEN = ".gss-written.json"
"""In a results directory: {file name: SHA-256} of the files gss wrote there, so that
``--overwrite`` replaces those, as written, and never a file of the user's (`check_outputs`)."""


def _written(out: Path) -> dict[str, str]:
    if (out / WRITTEN).is_symlink():  # not gss's record (`check_outputs` refuses it)
        return {}
    try:
        known = json.loads((out / WRITTEN).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def record_outputs(directory: str | Path, names: Iterable[str]) -> None:
    """Note the SHA-256 of each of ``names`` just written into ``directory`` by gss: a later
    ``--overwrite`` may replace them while they are as written."""
    out = Path(directory)
    known = _written(out)
    for name in names:
        if (out / name).is_file():
            known[name] = sha256_of(out / name)
    # a new file renamed over the record: a link there is replaced, never written through
    fd, tmp = tempfile.mkstemp(prefix=f"{WRITTEN}.", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(known, indent=1, sort_keys=True))
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, out / WRITTEN)


def check_outputs(
    directory: str | Path | None, names: Iterable[str], overwrite: bool, flag: str = "--out"
) -> None:
    """Refuse, before any work, to replace result files a command would write into
    ``directory`` unless ``overwrite``, and even then any that gss did not write there (or
    that changed since: `record_outputs`)."""
    if directory is None:
        return
    if not str(directory):
        raise GSSError(f"{flag} is empty: give a directory for the results.")
    out = through_link(Path(directory), flag)
    if out.exists() and not out.is_dir():
        raise GSSError(f"{flag} {out} is a file, not a directory: give a directory.")
    holds = _holds(out) if out.is_dir() else None
    if holds:  # results beside its files would be taken for its own, or block its save
        raise GSSError(
            f"{flag} {out} holds {holds}: results go into a directory of their own; choose "
            f"another {flag}."
        )
    inside = next((p for p in out.absolute().parents if _holds(p)), None)
    if inside is not None:  # an upload of that folder would publish the memorized rows too
        raise GSSError(
            f"{flag} {out} is inside {inside}, which holds {_holds(inside)}: results (rows "
            "the model memorized among them) must not travel with it when it is copied or "
            f"uploaded. Choose a {flag} outside it."
        )
    if not out.is_dir():
        check_creatable(out, flag)
    folders = [name for name in names if "." in name and (out / name).is_dir()]
    if folders:  # a file the command writes cannot replace a folder: refused before the work
        raise GSSError(
            f"{out / folders[0]} is a directory, and the command writes a file there: move it, "
            f"or choose another {flag}."
        )
    linked = [name for name in names if "." in name and (out / name).is_symlink()]
    if linked:  # a file written through a link (one to nothing yet too) lands elsewhere
        raise GSSError(
            f"{out / linked[0]} is a link (to {os.readlink(out / linked[0])}): gss writes no "
            f"result through a link, which would put it outside {out}. Remove the link, or "
            f"choose another {flag}."
        )
    record = out / WRITTEN  # gss's own record of what it wrote there, rewritten after the work
    if record.is_symlink() or (record.exists() and not record.is_file()):
        raise GSSError(
            f"{record} is {'a link' if record.is_symlink() else 'not a regular file'}: it is "
            f"where gss records the files it writes into {out}. Remove it, or choose another "
            f"{flag}."
        )
    existing = [name for name in names if (out / name).exists()]
    special = [n for n in existing if not ((out / n).is_file() or (out / n).is_dir())]
    if special:  # a device, pipe or socket: no file gss wrote, --overwrite or not
        raise GSSError(
            f"{out / special[0]} is not a regular file (a device, pipe or socket): gss writes "
            f"its results into files of its own. Choose another {flag}."
        )
    if existing and not overwrite:
        raise GSSError(
            f"{out} already holds {', '.join(existing)}: pass --overwrite (overwrite=True) to "
            f"replace {'it' if len(existing) == 1 else 'them'}, or choose another {flag}."
        )
    known = _written(out) if existing else {}
    theirs = [n for n in existing if (out / n).is_file() and known.get(n) != sha256_of(out / n)]
    if theirs:
        raise GSSError(
            f"{out / theirs[0]} was not written by gss (or was changed since): --overwrite "
            f"replaces only the files a gss run wrote there. Move it, or choose another {flag}."
        )


def _holds(directory: Path) -> str | None:
    """What ``directory`` holds that results must not be written into: "a gss artifact",
    "a model" (a config.json beside weights), or None."""
    if any((directory / n).is_file() for n in (CONFIG_NAME, STACK_NAME)):
        return "a gss artifact"
    if (directory / "config.json").is_file() and holds_weights(directory):
        return "a model"
    return None


def _place_card(out: Path, tmp: Path, card: str | None) -> None:
    """The new save's ``README.md``: the one already at ``out`` when a person wrote or edited
    it (never overwritten), else ``card``."""
    existing = out / CARD_NAME
    if existing.is_file() and not card_is_generated(existing):
        shutil.copy2(existing, tmp / CARD_NAME)
        warnings.warn(
            f"kept {existing}: gss did not write it (or it was edited since), so it was not "
            "replaced by a new model card and may describe the artifact it replaced. Delete it "
            "and save again for a card of this artifact.",
            GSSWarning,
            stacklevel=4,
        )
    elif card is not None:
        (tmp / CARD_NAME).write_text(card, encoding="utf-8")


def _is_artifact(path: Path) -> bool:
    return path.is_dir() and {p.name for p in path.iterdir()} <= set(ARTIFACT_FILES)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
