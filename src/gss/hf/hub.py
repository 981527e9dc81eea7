"""Models named by a Hugging Face Hub repo id: through the user's cache, offline when asked.

``--model org/name`` loads with ``from_pretrained`` as transformers would, with two things
made explicit so that they hold in any process, whatever was imported first: the cache
directory (``HF_HUB_CACHE``, else ``HF_HOME``/hub, read when the model loads, not when
huggingface_hub was imported) and offline mode (``HF_HUB_OFFLINE=1`` or
``TRANSFORMERS_OFFLINE=1``: ``local_files_only``, so nothing is asked of the network). Before
any weights load, the repo's ``config.json`` (or a PEFT adapter's ``adapter_config.json``) is
fetched alone: a wrong id, a missing revision, a gated or private repo, or a repo not cached
while offline fails in seconds, as one `GSSError` that says what to do.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from safetensors import SafetensorError

from gss.errors import GSSError
from gss.file_names import CONFIG_NAME, STACK_NAME

__all__ = [
    "ModelSource",
    "cache_dir",
    "check_dataset",
    "hub_environment",
    "hub_error",
    "hub_id",
    "hub_options",
    "load_error",
    "load_failure",
    "offline",
    "resolve",
]

T = TypeVar("T")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_id(name: object) -> str | None:
    """``name`` as a Hub repo id, or None: a str shaped ``org/name`` that names no local path.
    A `pathlib.Path`, a path that exists, an absolute, ``./`` or ``~`` path are local."""
    if not isinstance(name, str) or not _REPO_ID.fullmatch(name) or ".." in name:
        return None
    if Path(name).expanduser().exists():
        return None  # a local directory wins, as in transformers
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set: read now, so that a
    notebook or a test that sets it after importing transformers is obeyed too."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if env:  # as huggingface_hub reads them at its import
        return env.strip().upper() in _TRUE
    return bool(constants.HF_HUB_OFFLINE)  # unset: as imported (or as a program set it)


def cache_dir() -> str:
    """The Hub cache models load through: ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``,
    else ``HF_HOME``/hub (as huggingface_hub reads them, but now rather than at its import),
    else huggingface_hub's default."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expandvars(os.path.expanduser(os.environ[name]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expandvars(os.path.expanduser(os.environ["HF_HOME"])), "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


@contextmanager
def hub_environment() -> Iterator[None]:
    """For the length of a load, huggingface_hub's offline flag and cache as `offline` and
    `cache_dir` read them now. They are set where huggingface_hub was imported before the
    environment changed (a notebook, a test), because not every call inside
    ``from_pretrained`` passes ``local_files_only`` and ``cache_dir`` on (transformers 5's
    PEFT adapter check does not): offline then means no connection at all, as
    huggingface_hub refuses every request while its flag is set. Put back after."""
    import huggingface_hub.constants as hub_constants

    targets: list[tuple[Any, str, Any]] = [
        (hub_constants, "HF_HUB_OFFLINE", offline()),
        (hub_constants, "HF_HUB_CACHE", cache_dir()),
    ]
    try:  # older transformers keep a copy of the flag, made at their import
        import transformers.utils.hub as transformers_hub

        if hasattr(transformers_hub, "_is_offline_mode"):
            targets.append((transformers_hub, "_is_offline_mode", offline()))
    except ImportError:
        pass
    saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
    try:
        for module, name, value in targets:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def hub_options(revision: str | None = None) -> dict[str, Any]:
    """``from_pretrained``'s keywords for a Hub id: the cache, offline mode, the revision."""
    options: dict[str, Any] = {"cache_dir": cache_dir(), "local_files_only": offline()}
    if revision is not None:
        options["revision"] = revision
    return options


@dataclass(frozen=True)
class ModelSource:
    """Where a model loads from: ``name`` (a local directory, or a Hub repo id when ``repo``),
    the keywords ``from_pretrained`` takes for it, and the base a PEFT adapter names."""

    name: str
    repo: bool = False
    revision: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    adapter_base: str | None = None

    def describe(self) -> str:
        """How messages name it: the directory, or the repo id and revision."""
        return self.name + (f" (revision {self.revision!r})" if self.revision else "")


def download_command(repo_id: str, revision: str | None = None) -> str:
    """The command that puts the whole repo ``repo_id`` (at ``revision``) in the Hub cache."""
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def resolve(repo_id: str, revision: str | None = None) -> ModelSource:
    """The Hub model ``repo_id`` at ``revision``: its ``config.json`` (or, for a PEFT adapter,
    ``adapter_config.json``) fetched into the cache, or found there offline, so that every
    problem with the repo is said before weights load."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

    source = ModelSource(repo_id, True, revision, hub_options(revision))
    missing_here = False  # a file the cache lacks, offline (rather than one the repo lacks)

    def fetch(filename: str) -> Path | None:
        nonlocal missing_here
        try:
            return Path(
                hf_hub_download(
                    repo_id,
                    filename,
                    revision=revision,
                    cache_dir=cache_dir(),
                    local_files_only=offline(),
                )
            )
        except LocalEntryNotFoundError:  # before its base class: not cached, and offline
            if not _cached_repo(repo_id):
                raise
            missing_here = True
            return None
        except EntryNotFoundError:  # the repo has no such file
            return None

    try:
        with hub_environment():
            if fetch("config.json") is not None:
                return source
            # no config.json: a PEFT adapter repo names its base model instead
            adapter_file = fetch("adapter_config.json")
            # nor that: a gss artifact's repo, given where a model goes?
            steer = adapter_file is None and any(
                fetch(name) is not None for name in (CONFIG_NAME, STACK_NAME)
            )
    except Exception as e:  # huggingface_hub's and the HTTP client's errors, said in one line
        raise GSSError(hub_error(e, repo_id, revision)) from None
    if steer:
        raise GSSError(
            f"the Hub repo {source.describe()} is a gss steering artifact, not a model: give it "
            "with --steer (gss.load), and the model it was calibrated on with --model."
        )
    if adapter_file is None and missing_here:
        raise GSSError(
            f"the Hub cache ({cache_dir()}) holds part of {source.describe()} only (neither its "
            f"config.json nor an adapter_config.json), and the Hub cannot be asked "
            f"({'HF_HUB_OFFLINE is set' if offline() else 'no network'}): run "
            f"`{download_command(repo_id, revision)}` once online, or give the model's directory."
        )
    if adapter_file is None:
        raise GSSError(
            f"the Hub repo {source.describe()} is not a model repo: it has neither config.json "
            "nor adapter_config.json. Give the repo of a causal LM (or of a PEFT adapter)."
        )
    base = json.loads(adapter_file.read_text()).get("base_model_name_or_path")
    return ModelSource(repo_id, True, revision, source.options, str(base) if base else None)


def _cached_repo(repo_id: str, kind: str = "model") -> bool:
    """Whether the cache holds anything of the ``kind`` repo ``repo_id`` (so a missing
    config.json there may be an adapter repo's, cached without one)."""
    return (Path(cache_dir()) / f"{kind}s--{repo_id.replace('/', '--')}").is_dir()


def check_dataset(name: str) -> None:
    """Before ``datasets`` loads the Hub dataset ``name``: one request, without retries, so
    that a wrong path or id, or a Hub that cannot be reached, is said in a second (datasets
    retries for ~25 s first, where a name does not resolve). Nothing is asked offline (for
    datasets too: ``HF_DATASETS_OFFLINE``) or for a dataset the cache holds: datasets falls
    back to the cache when the Hub is down."""
    if offline() or _datasets_offline() or _cached_dataset(name):
        return
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(name, timeout=10)
    except (RepositoryNotFoundError, HFValidationError):
        raise GSSError(
            f"{name} is neither a local file or directory nor a Hub dataset you can read: "
            "check the path or the dataset id; for a private dataset, log in (`hf auth login`, "
            "or set HF_TOKEN)."
        ) from None
    except HfHubHTTPError:
        return  # gated, rate-limited, a server error: datasets says what
    except Exception as e:
        if not _network_error(e):
            return
        raise GSSError(
            f"{name} is not a local file or directory, and the Hub cannot be reached to look "
            f"for it as a dataset ({type(e).__name__}: {first_line(e)}): check the path; for a "
            "Hub dataset, check the network (or HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to load "
            "it from your cache."
        ) from None


def _datasets_offline() -> bool:
    """Whether datasets loads offline: ``HF_DATASETS_OFFLINE`` read now, else its flag as
    datasets set it at its import (or as a program set it since)."""
    env = os.environ.get("HF_DATASETS_OFFLINE")
    if env:
        return env.strip().upper() in _TRUE
    try:
        from datasets import config
    except ImportError:
        return False
    return bool(getattr(config, "HF_HUB_OFFLINE", False))


def _cached_dataset(name: str) -> bool:
    """Whether the Hub cache holds files of the dataset ``name``, or datasets' cache a table
    made from it (where datasets loads it from when the Hub is down)."""
    if _cached_repo(name, "dataset"):
        return True
    try:
        from datasets import config
    except ImportError:
        return False
    return (Path(config.HF_DATASETS_CACHE) / name.replace("/", "___")).is_dir()


def _network_error(e: BaseException) -> bool:
    """Whether ``e`` says the connection failed (requests', httpx's or the socket's errors)."""
    names = {"TransportError", "TimeoutException", "ConnectionError", "Timeout"}
    return isinstance(e, OSError) or any(kind.__name__ in names for kind in type(e).__mro__)


def hub_error(e: Exception, repo_id: str, revision: str | None, what: str = "model") -> str:
    """What went wrong fetching ``repo_id`` (a ``what``: a model, an artifact) from the Hub,
    and the fix, in a sentence or two."""
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = repo_id + (f" (revision {revision!r})" if revision else "")
    fetch = f"`{download_command(repo_id, revision)}`"
    if isinstance(e, RevisionNotFoundError):
        return (
            f"the Hub repo {repo_id} has no revision {revision!r}: give a branch, tag or commit "
            "it has, or leave the revision out for its main branch."
        )
    if isinstance(e, GatedRepoError):
        return (
            f"the Hub repo {repo_id} is gated: accept its conditions on its page, then log in "
            "(`hf auth login`, or set HF_TOKEN)."
        )
    if isinstance(e, RepositoryNotFoundError):
        return (
            f"{repo_id} is neither a local directory nor a Hub repo you can read: check the "
            "path or the repo id; for a private repo, log in (`hf auth login`, or set HF_TOKEN)."
        )
    if isinstance(e, LocalEntryNotFoundError):
        if type(e).__name__ == "IncompleteSnapshotError":
            return (
                f"the local Hub cache holds part of {at} only, and the Hub cannot be reached: "
                f"run {fetch} once online to complete it."
            )
        if offline():
            return (
                f"{at} is not in the local Hub cache ({cache_dir()}) and HF_HUB_OFFLINE is "
                f"set, and no directory of that name is here: run {fetch} once online, point "
                f"HF_HUB_CACHE at the cache that holds it, unset HF_HUB_OFFLINE, or give the "
                f"{what}'s directory (a path that exists)."
            )
        return (
            f"{at} is not a local directory, the Hub cannot be reached to fetch it, and it is "
            f"not in the local Hub cache ({cache_dir()}): check the network (or HF_ENDPOINT), "
            f"then run {fetch}, or give the {what}'s directory."
        )
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return f"the Hub refused to send {at} (HTTP {status}): {first_line(e)}"
    return f"could not fetch {at} from the Hub ({type(e).__name__}: {first_line(e)})."


def first_line(e: BaseException) -> str:
    """An exception's message, first line only (transformers' run to paragraphs)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def summary(e: BaseException, limit: int = 400) -> str:
    """An exception's message on one line, cut at ``limit`` characters: transformers' run to
    paragraphs whose first line alone may say nothing ("from one of:")."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_failure(source: ModelSource, what: str, e: BaseException) -> GSSError:
    """What transformers or the Hub raised loading ``what`` from ``source``, as one
    `GSSError` that names it (and, offline, the cache it had to be in)."""
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    if source.repo and isinstance(e, (HfHubHTTPError, LocalEntryNotFoundError)):
        return GSSError(hub_error(e, source.name, source.revision))
    hint = ""
    # transformers 4.x meets a cache without the weights with an AttributeError, 5.x an OSError
    if source.repo and offline() and isinstance(e, (OSError, AttributeError)):
        fetch = download_command(source.name, source.revision)
        hint = (
            f" With HF_HUB_OFFLINE set, every file must be in the Hub cache ({cache_dir()}), "
            f"which may hold part of the repo only: run `{fetch}` once online."
        )
    return GSSError(
        f"could not load {what} from {source.describe()} ({type(e).__name__}: {summary(e)}).{hint}"
    )


LOAD_ERRORS = (
    OSError,
    ValueError,
    ImportError,
    RuntimeError,
    KeyError,
    TypeError,  # a config.json that holds no JSON object (a list)
    AttributeError,  # a tokenizer_config.json that holds no JSON object
    SafetensorError,  # a damaged weights file
    pickle.UnpicklingError,  # a pickled .bin torch's restricted unpickler refused
    RecursionError,  # a config nested past Python's limit
)
"""What transformers or the Hub raise for a model, config or tokenizer that does not load."""


def load_error(source: ModelSource, what: str, call: Callable[[], T]) -> T:
    """``call()`` (a ``from_pretrained``), with what transformers or the Hub raise said as
    one `GSSError` (`load_failure`), never a traceback."""
    try:
        with hub_environment():
            return call()
    except GSSError:
        raise
    except LOAD_ERRORS as e:
        raise load_failure(source, what, e) from e
