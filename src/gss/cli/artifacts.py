"""`gss show` and `gss push`: what a saved steer is, and putting it on the Hugging Face Hub."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gss.cli.options import HUB_ID, add_command
from gss.errors import GSSError

if TYPE_CHECKING:
    from gss.cli.options import Commands


def show_command(args: argparse.Namespace) -> int:
    from gss.artifact.stack import SteeringStack, load

    artifact = load(args.artifact, revision=args.revision)  # a directory or a Hub repo id
    if args.json:
        members = artifact.artifacts if isinstance(artifact, SteeringStack) else (artifact,)
        described = [
            {"config": a.config.to_dict(), "provenance": dataclasses.asdict(a.provenance)}
            for a in members
        ]
        print(json.dumps(described[0] if len(described) == 1 else described, indent=2))
    else:
        print(artifact.describe())
    return 0


def push_command(args: argparse.Namespace) -> int:
    from gss.artifact.card import card_is_generated
    from gss.artifact.stack import load
    from gss.file_names import CARD_NAME

    directory = Path(args.artifact)
    if not directory.is_dir():
        raise GSSError(
            f"{directory} is not a directory: give the directory of a saved artifact (gss "
            "calibrate --out, gss protect's steer/, gss sweep --save)."
        )
    steer = load(directory)  # every check of a load, before anything is uploaded
    card, own = None, directory / CARD_NAME
    if args.model_card:
        try:
            card = Path(args.model_card).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GSSError(f"--model-card {args.model_card} does not read as text ({e}).") from None
    elif own.is_file() and not card_is_generated(own):
        card = own.read_text(encoding="utf-8", errors="replace")  # the user's own: theirs to push
        print(f"uploading {own} as the model card (you wrote or edited it)")
    info = steer.push_to_hub(
        args.repo_id,
        revision=args.revision,
        private=True if args.private else None,  # not given: an existing repo's stays
        commit_message=args.commit_message,
        create_pr=args.create_pr,
        model_card=card,
    )
    url = getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or args.repo_id
    at = f" --revision {args.revision}" if args.revision else ""
    print(
        f"pushed {directory} to {args.repo_id} ({url}): gss.load({args.repo_id!r}), "
        f"gss show {args.repo_id}{at}, gss generate --steer {args.repo_id}"
    )
    return 0


def add_show_parser(sub: Commands) -> None:
    summary = "what a steering artifact steers, how it was calibrated, its gates"
    p = add_command(sub, "show", summary, show_command)
    p.add_argument("artifact", help=f"artifact directory from `gss calibrate`, {HUB_ID}")
    p.add_argument("--revision", help="with a Hub repo id: its branch, tag or commit")
    p.add_argument("--json", action="store_true", help="print the whole config as JSON")


def add_push_parser(sub: Commands) -> None:
    summary = "upload a steering artifact and its model card to a Hugging Face Hub repo"
    p = add_command(sub, "push", summary, push_command)
    p.add_argument("artifact", metavar="ARTIFACT_DIR", help="the artifact's (or stack's) directory")
    p.add_argument("repo_id", metavar="REPO_ID", help="the Hub model repo, org/name (created)")
    p.add_argument("--revision", help="the branch to push to (created from main if new)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--commit-message", help="the commit's message")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead")
    p.add_argument(
        "--model-card",
        metavar="FILE",
        help="upload FILE as the repo's README.md (default: the directory's README.md if you "
        "wrote or edited it, else the card gss writes; a README on the Hub that gss did not "
        "write is kept)",
    )


# each command's parser, by name (`gss.cli.parser` puts them in `gss --help`'s order)
PARSERS: dict[str, Callable[[Commands], None]] = {
    "show": add_show_parser,
    "push": add_push_parser,
}
