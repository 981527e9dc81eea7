"""SteeringStack: several blocks' steers, attached together as one.

When no single block removes what a model regurgitates within the utility budget, `gss
protect` adds a block calibrated on the model already steered at the blocks before it. Those
steers belong together: the later ones were measured with the earlier ones in place, so they
are saved, loaded, attached and removed as one. On disk a stack is a directory holding
``gss_stack.json`` (the order, and each member's tensors checksum) and one ordinary artifact
directory per member (``steer-0``, ``steer-1``, ...), written with the same atomic save, beside
one model card (``README.md``) for the whole stack. On the Hub, a repo holds the same files
(`push_to_hub`, `gss.load("org/name")`: `gss.artifact.hub`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from gss._version import __version__
from gss.artifact import hub
from gss.artifact.card import model_card
from gss.artifact.files import sha256_of, write_atomically
from gss.artifact.fingerprint import fingerprint_differences
from gss.artifact.steering_artifact import SteeringArtifact
from gss.errors import GSSError
from gss.file_names import STACK_NAME, TENSORS_NAME
from gss.steering.attach import SteerHandle

STACK_FORMAT_VERSION = 1
MEMBER = re.compile(r"steer-\d+")


@dataclass(frozen=True)
class SteeringStack(hub.HubMixin):
    """Steers for several blocks, in the order they were calibrated (each on the model steered
    by the ones before it); attached together, removed together."""

    artifacts: tuple[SteeringArtifact, ...]

    def __post_init__(self) -> None:
        if not self.artifacts:
            raise GSSError("a SteeringStack needs at least one SteeringArtifact.")
        for a in self.artifacts:
            if not isinstance(a, SteeringArtifact):
                raise GSSError(f"a SteeringStack holds SteeringArtifacts, got {type(a).__name__}.")
        seen: set[int] = set()
        for a in self.artifacts:
            if a.layer in seen:
                raise GSSError(
                    f"a SteeringStack holds two steers of block {a.layer} (or one twice): it "
                    "would steer that block twice. A stack holds one steer per block."
                )
            seen.add(a.layer)
        first = self.artifacts[0]
        for i, a in enumerate(self.artifacts[1:], start=1):
            diffs = fingerprint_differences(first.provenance.fingerprint, a.provenance.fingerprint)
            if diffs:  # would fail only at attach, on whichever model, naming no member
                raise GSSError(
                    f"a SteeringStack's members are steers of one model, and member {i} "
                    f"(block {a.layer}) was calibrated on another model than member 0 (block "
                    f"{first.layer}): {'; '.join(diffs)} (member 0 read as the artifact, member "
                    f"{i} as the model). Build the stack from steers calibrated on one model."
                )
        object.__setattr__(self, "artifacts", tuple(self.artifacts))

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(a.layer for a in self.artifacts)

    def __len__(self) -> int:
        return len(self.artifacts)

    def __iter__(self) -> Iterator[SteeringArtifact]:
        return iter(self.artifacts)

    def __repr__(self) -> str:
        return f"SteeringStack(layers={list(self.layers)}, artifacts={list(self.artifacts)})"

    def describe(self) -> str:
        parts = [
            f"steering stack: {len(self)} blocks {list(self.layers)}, attached together "
            "(each calibrated on the model steered by the ones before it)"
        ]
        for i, a in enumerate(self.artifacts):
            parts.append(f"\n--- steer {i} (block {a.layer}) ---\n{a.describe()}")
        return "\n".join(parts)

    def check_model(self, model: nn.Module, strict: bool = True) -> None:
        for a in self.artifacts:
            a.check_model(model, strict=strict)

    def attach(
        self,
        model: nn.Module,
        *,
        strict: bool = True,
        track_gates: bool = False,
        **options: Any,
    ) -> StackHandle:
        """Attach every member (all or none: a member that fails removes the ones before it).

        Options such as ``delta`` differ per block and are chosen together, so they are not
        broadcast: change a member with ``with_member`` instead."""
        if options:
            raise GSSError(
                f"a steering stack takes no options ({', '.join(sorted(options))}): its blocks' "
                "strengths were chosen together. Change one block with "
                "stack.with_member(i, delta=...), or attach a single artifact."
            )
        handles: list[SteerHandle] = []
        try:
            for a in self.artifacts:
                handles.append(a.attach(model, strict=strict, track_gates=track_gates))
        except BaseException:
            for h in reversed(handles):
                h.remove()
            raise
        return StackHandle(handles)

    def with_member(self, index: int, **changes: Any) -> SteeringStack:
        """A copy with member ``index`` changed by `SteeringArtifact.with_options`."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise GSSError(f"a member is given by its index (an integer), got {index!r}.")
        if not -len(self) <= index < len(self):
            raise GSSError(f"this stack has {len(self)} members, no member {index}.")
        members = list(self.artifacts)
        members[index] = members[index].with_options(**changes)
        return SteeringStack(tuple(members))

    def save_pretrained(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write the manifest, one artifact directory per member and the stack's model card
        (``README.md``), atomically (all or none); a README someone wrote or edited is kept."""
        card = model_card(self, str(directory))
        return write_atomically(directory, overwrite, self.write_into, card)

    def write_into(self, directory: Path) -> None:
        """The manifest and the members' directories, into ``directory`` as it is (the step
        `save_pretrained` and `push_to_hub` run inside their temporary directory)."""
        names = []
        for i, a in enumerate(self.artifacts):
            name = f"steer-{i}"
            (directory / name).mkdir()
            a.write_into(directory / name)
            names.append(
                {
                    "dir": name,
                    "layer": a.layer,
                    "tensors_sha256": sha256_of(directory / name / TENSORS_NAME),
                }
            )
        manifest = {
            "format": "gss-stack",
            "format_version": STACK_FORMAT_VERSION,
            "gss_version": __version__,
            "members": names,
        }
        (directory / STACK_NAME).write_text(json.dumps(manifest, indent=2))

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        revision: str | None = None,
        token: str | bool | None = None,
    ) -> SteeringStack:
        """Load a stack from its directory, or from a Hub repo id at ``revision``."""
        path = hub.local_path(directory, revision, token)
        manifest_path = path / STACK_NAME
        try:
            raw = json.loads(manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise GSSError(f"{path} is not a gss steering stack: no {STACK_NAME} in it.") from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise GSSError(
                f"{manifest_path} is not valid JSON ({e}): the stack is damaged."
            ) from None
        if not isinstance(raw, dict) or raw.get("format") != "gss-stack":
            raise GSSError(f"{manifest_path} is not a gss stack manifest: the stack is damaged.")
        if raw.get("format_version") != STACK_FORMAT_VERSION:
            raise GSSError(
                f"{path} has stack format version {raw.get('format_version')}, this gss reads "
                f"{STACK_FORMAT_VERSION}. Install the gss version that wrote it "
                f"({raw.get('gss_version')})."
            )
        members = raw.get("members")
        if not isinstance(members, list) or not members:
            raise GSSError(f"{manifest_path} lists no members: the stack is damaged.")
        artifacts = []
        listed: set[str] = set()
        for entry in members:
            name = entry.get("dir") if isinstance(entry, dict) else None
            if not isinstance(name, str) or not MEMBER.fullmatch(name):
                raise GSSError(f"{manifest_path} has a bad member entry {entry!r}: damaged.")
            member = path / name
            if name in listed:
                raise GSSError(f"{manifest_path} lists {name} twice: the stack is damaged.")
            listed.add(name)
            artifact = SteeringArtifact.from_pretrained(member)
            if entry.get("tensors_sha256") != sha256_of(member / TENSORS_NAME):
                raise GSSError(
                    f"{member} is not the steer {STACK_NAME} was saved with (its tensors' "
                    "SHA-256 differs): save the stack again, or copy all of one save."
                )
            artifacts.append(artifact)
        on_disk = {p.name for p in path.iterdir() if MEMBER.fullmatch(p.name)}
        unlisted = sorted(on_disk - listed)
        if unlisted:  # a member taken off the manifest would silently steer one block less
            raise GSSError(
                f"{path} holds {', '.join(unlisted)}, which {STACK_NAME} does not list: the "
                "stack is damaged (or its manifest edited). Save the stack again, or copy all "
                "of one save."
            )
        return cls(tuple(artifacts))


class StackHandle:
    """The handles of a stack's members: removed together; also a context manager."""

    def __init__(self, handles: Sequence[SteerHandle]) -> None:
        self.handles = list(handles)

    @property
    def active(self) -> bool:
        return any(h.active for h in self.handles)

    def remove(self) -> None:
        for h in reversed(self.handles):  # the last attached is the outermost wrapper
            h.remove()

    def gate_stats(self) -> dict[str, Any]:
        """Each block's gate counters; ``any_open_share`` is the largest block's share (a
        lower bound of how often some gate opened: blocks are counted apart)."""
        blocks = [h.gate_stats() for h in self.handles]
        shares = [b.get("any_open_share", 0.0) for b in blocks]
        return {
            "tokens": max((b.get("tokens", 0) for b in blocks), default=0),
            "blocks": blocks,
            "any_open_share": max(shares, default=0.0),
        }

    def reset_stats(self) -> None:
        for h in self.handles:
            h.reset_stats()

    def __enter__(self) -> StackHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


Steer = SteeringArtifact | SteeringStack


def load(
    directory: str | Path, *, revision: str | None = None, token: str | bool | None = None
) -> Steer:
    """Load a saved :class:`SteeringArtifact`, or a :class:`SteeringStack` (several blocks'
    steers saved as one, as `gss protect` writes when one block is not enough).

    ``directory`` is the artifact's directory, or a Hub repo id (``"org/name"``, a str that
    names no local path) read at ``revision`` through the local Hub cache, which
    ``HF_HUB_OFFLINE=1`` keeps to (`gss.artifact.hub`); ``token`` for a private repo."""
    if not isinstance(directory, (str, os.PathLike)):
        raise GSSError(
            f"give the directory of a saved artifact or a Hub repo id, got "
            f"{type(directory).__name__}."
        )
    path = hub.local_path(directory, revision, token)
    if (path / STACK_NAME).is_file():
        return SteeringStack.from_pretrained(path)
    return SteeringArtifact.from_pretrained(path)


def check_steer(artifact: Any) -> None:
    """Refuse what is not a steer (a path not yet loaded, the None of a `gss.protect` that
    found nothing within its budget) before it fails as an AttributeError."""
    if not isinstance(artifact, (SteeringArtifact, SteeringStack)):
        raise GSSError(
            f"expected a SteeringArtifact or SteeringStack, got {type(artifact).__name__}"
            + (" (gss.protect found no steer within its budget?)" if artifact is None else "")
            + ": load a saved one with gss.load(path)."
        )


@contextmanager
def steer(model: nn.Module, artifact: Steer, **options: Any) -> Iterator[SteerHandle | StackHandle]:
    """``with gss.steer(model, artifact): ...`` steers inside the block(s) and never after."""
    check_steer(artifact)
    handle = artifact.attach(model, **options)
    try:
        yield handle
    finally:
        handle.remove()


__all__ = ["STACK_FORMAT_VERSION", "StackHandle", "Steer", "SteeringStack", "load", "steer"]
