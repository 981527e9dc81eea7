"""Artifacts on the Hugging Face Hub: pushed as a model repo, loaded by repo id.

A steering artifact is small (K x d floats and a JSON file), so it is shared the way PEFT
shares an adapter: ``push_to_hub`` writes the artifact and its model card into a temporary
directory and uploads that folder as one commit; ``gss.load("org/name")`` downloads the
snapshot with `huggingface_hub.snapshot_download` and reads it as a local directory. The
download goes through the user's Hub cache (``HF_HUB_CACHE`` / ``HF_HOME``) and honours
``HF_HUB_OFFLINE=1``, so a repo fetched once loads offline after. Every check of a local load
applies unchanged (format, checksums, tensors; the model fingerprint when attached).

What the Hub can fail with (no such repo or revision, no access, no network, offline and not
cached) becomes one `GSSError` that names the problem and the fix, never a traceback of
huggingface_hub.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gss.artifact.card import is_generated, members
from gss.artifact.card import model_card as generated_card
from gss.errors import GSSError, GSSWarning
from gss.file_names import CARD_NAME, CONFIG_NAME, STACK_NAME, TENSORS_NAME
from gss.hf.hub import cache_dir, first_line, hub_error, hub_id, offline

if TYPE_CHECKING:
    from gss.artifact.stack import Steer

# what a repo holds of an artifact: a steer, or a stack's manifest and members (no README:
# loading does not read it)
ARTIFACT_PATTERNS = [
    CONFIG_NAME,
    TENSORS_NAME,
    STACK_NAME,
    f"steer-*/{CONFIG_NAME}",
    f"steer-*/{TENSORS_NAME}",
]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # what a repo id to push to looks like


def hub_repo_id(source: object) -> str | None:
    """``source`` as a Hub repo id, or None: a str shaped ``org/name`` that names no local
    path (`gss.hf.hub.hub_id`, as for models). A `pathlib.Path`, a path that exists, an
    absolute or ``./`` path are local."""
    return hub_id(source)


def local_path(
    source: str | os.PathLike[str], revision: str | None = None, token: str | bool | None = None
) -> Path:
    """The local directory of ``source``: itself, or for a Hub repo id the snapshot of
    ``revision`` in the Hub cache (downloaded when not cached and not offline)."""
    repo_id = hub_repo_id(source)
    if repo_id is None:
        if revision is not None:
            raise GSSError(
                f"revision={revision!r} names a revision of a Hub repo, and {source} is a local "
                "path: leave revision (gss show --revision) out, or give the repo id (org/name)."
            )
        return Path(source)
    return download(repo_id, revision=revision, token=token)


def download(repo_id: str, revision: str | None = None, token: str | bool | None = None) -> Path:
    """The artifact files of ``repo_id`` at ``revision`` (default: its main branch), from the
    Hub cache or downloaded into it; a repo with no gss artifact at its top is refused."""
    from huggingface_hub import snapshot_download

    at = f"{repo_id}" + (f" (revision {revision!r})" if revision else "")
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                token=token,
                allow_patterns=ARTIFACT_PATTERNS,
                library_name="gss",
                # read now, not at huggingface_hub's import: a process that sets them is obeyed
                cache_dir=cache_dir(),
                local_files_only=offline(),
            )
        )
    except Exception as e:  # huggingface_hub's and the HTTP client's errors, said in one line
        raise GSSError(hub_error(e, repo_id, revision, "artifact")) from None
    if not (folder / CONFIG_NAME).is_file() and not (folder / STACK_NAME).is_file():
        raise GSSError(
            f"the Hub repo {at} holds no gss artifact: neither {CONFIG_NAME} nor {STACK_NAME} "
            "at its top. Give the repo an artifact was pushed to (`gss push DIR REPO_ID`, "
            "artifact.push_to_hub), not a model's."
        )
    return folder


class HubMixin:
    """``push_to_hub`` for the two things gss saves, an artifact and a stack (as
    transformers' ``PushToHubMixin`` gives it to models and PEFT's to adapters)."""

    def push_to_hub(
        self,
        repo_id: str,
        *,
        revision: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
        create_pr: bool = False,
        exist_ok: bool = True,
        model_card: str | None = None,
    ) -> Any:
        """Upload this steer (an artifact or a stack) to the Hub model repo ``repo_id`` as one
        commit, creating the repo (``private``) if needed; returns huggingface_hub's
        CommitInfo; ``gss.load(repo_id)`` loads it back.

        The commit holds the artifact's files and ``README.md``: ``model_card`` if given, else
        the card gss writes (`gss.artifact.card`), unless the repo already has a README that
        gss did not write (or one edited since), which is kept. Artifact files of an earlier
        push that this one does not have (a stack's members, say) are deleted, so the repo
        loads as this steer. ``revision``: a branch to push to (created from main if new);
        ``create_pr``: open a pull request instead of committing to the branch.
        """
        from huggingface_hub import HfApi

        if not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
            raise GSSError(
                f"repo_id must be a Hub repo id, org/name (or user/name), got {repo_id!r}."
            )
        if offline():
            raise GSSError(
                f"pushing to {repo_id} needs the network, and HF_HUB_OFFLINE is set: unset it."
            )
        api = HfApi(token=token, library_name="gss")
        where = repo_id + (f" (branch {revision})" if revision else "")
        with tempfile.TemporaryDirectory(prefix="gss-push-") as tmp:
            folder = Path(tmp)
            steer = cast("Steer", self)
            steer.write_into(folder)
            try:
                api.create_repo(repo_id, private=private, exist_ok=exist_ok, repo_type="model")
                if revision is not None and not revision.startswith("refs/pr/"):
                    api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
                card = (
                    model_card
                    if model_card is not None
                    else _card_for(api, steer, repo_id, revision)
                )
                if card is not None:
                    (folder / CARD_NAME).write_text(card, encoding="utf-8")
                return api.upload_folder(
                    repo_id=repo_id,
                    folder_path=folder,
                    repo_type="model",
                    revision=revision,
                    commit_message=commit_message or _default_message(steer),
                    create_pr=create_pr,
                    delete_patterns=ARTIFACT_PATTERNS,  # a stale member; kept where uploaded anew
                )
            except GSSError:
                raise
            except Exception as e:
                raise GSSError(_push_error(e, where, exist_ok)) from None


def _card_for(api: Any, steer: Steer, repo_id: str, revision: str | None) -> str | None:
    """gss's card for ``repo_id``, or None where the repo's own README is someone's: kept."""
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    try:
        existing = api.hf_hub_download(
            repo_id, CARD_NAME, revision=revision, repo_type="model", cache_dir=cache_dir()
        )
    except (EntryNotFoundError, RevisionNotFoundError):
        existing = None
    if existing is not None:
        try:
            text = Path(existing).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = ""
        if not is_generated(text):
            warnings.warn(
                f"kept the README.md of {repo_id}: gss did not write it (or it was edited "
                "since), so the push does not replace it; pass model_card= (gss push "
                "--model-card) to upload a card.",
                GSSWarning,
                stacklevel=3,  # the caller of push_to_hub
            )
            return None
    return generated_card(steer, repo_id)


def _default_message(steer: Steer) -> str:
    layers = [a.layer for a in members(steer)]
    if len(layers) == 1:
        return f"Upload gss steering artifact (block {layers[0]})"
    return f"Upload gss steering stack (blocks {layers})"


def _push_error(e: Exception, where: str, exist_ok: bool) -> str:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return f"pushing to {where} needs the network, and HF_HUB_OFFLINE is set: unset it."
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status == 409 and not exist_ok:
        return f"the Hub repo {where} already exists: pass exist_ok=True to push to it."
    if isinstance(e, HfHubHTTPError) and status in (401, 403, 404):
        return (
            f"the Hub refused the push to {where} (HTTP {status}): log in with a token that "
            "may write there (`hf auth login`, or token=...), or choose a namespace you own."
        )
    if isinstance(e, HfHubHTTPError):
        return f"the Hub refused the push to {where} (HTTP {status}): {first_line(e)}"
    return f"could not push to {where} ({type(e).__name__}: {first_line(e)})."
