"""`gss show` and `gss push`: what a saved steer is, and putting it on the Hugging Face Hub."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from gss.errors import GSSError


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
