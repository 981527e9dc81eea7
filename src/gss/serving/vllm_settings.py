"""Which gss artifacts a vLLM engine serves, under which names, and which one a request asks for.

Setup (every vLLM process, engine and workers, reads the same environment)::

    from gss.serving import vllm_plugin
    vllm_plugin.configure({"no-leaks": "/path/to/artifact"})   # sets GSS_VLLM_ARTIFACTS
    llm = vllm.LLM(model_dir, dtype="float32")
    llm.generate(prompts, SamplingParams(max_tokens=32, extra_args={"gss": "no-leaks"}))

and over the OpenAI server: ``gss serve --model DIR --artifact no-leaks=/path`` (vLLM's
server with ``--additional-config '{"gss_artifacts": {"no-leaks": "/path"}}'``, see
`gss.serving.serve` and docs/serving.md) with ``"vllm_xargs": {"gss": "no-leaks"}`` in the
request body (``extra_body`` in the OpenAI client). A request without the ``gss`` key is not
steered, bit for bit, unless the server has a default artifact (``gss serve --default NAME``,
``additional_config={"gss_default": NAME}``, ``configure(..., default=NAME)``): then it is
steered by that one, and no client can switch it off: a request asking for ``{"gss": "none"}``
is refused (HTTP 400) unless the operator allows it (``gss serve --allow-opt-out``,
``additional_config={"gss_allow_opt_out": true}``, ``configure(..., allow_opt_out=True)``).
One naming an artifact the server does not have is refused too.

This module imports neither torch nor vLLM: `gss serve` checks its arguments with it, before
it starts the server, and the op (`gss.serving.vllm_op`) and vLLM's hooks
(`gss.serving.vllm_plugin`) read the same names from it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "GSS_VLLM_ARTIFACTS"
"""JSON object {name: artifact directory}, or ``name=dir,name2=dir2``."""
EXTRA_ARG = "gss"
"""The key of ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP) naming the artifact."""
CONFIG_KEY = "gss_artifacts"
"""The key of vLLM's ``additional_config`` that may name the artifacts instead of ``ENV``."""
PLUGIN_NAME = "gss"
"""The entry point's name (what ``VLLM_PLUGINS`` lists to allow it)."""
DEFAULT_KEY = "gss_default"
"""The key of ``additional_config`` naming the artifact that steers requests naming none."""
DEFAULT_ENV = "GSS_VLLM_DEFAULT"
"""The same as an environment variable (``configure(..., default=NAME)`` sets it)."""
OPT_OUT_KEY = "gss_allow_opt_out"
"""The key of ``additional_config`` that lets a request opt out of the default (``"none"``)."""
OPT_OUT_ENV = "GSS_VLLM_ALLOW_OPT_OUT"
"""The same as an environment variable (``1``; ``configure(..., allow_opt_out=True)``)."""
TRITON_ENV = "GSS_VLLM_TRITON"
"""``0``: the op steers with torch's ops on CUDA too; ``1``: with the Triton kernel anywhere;
unset or ``auto``: the kernel on CUDA where Triton is (`gss.serving.vllm_op.use_triton`)."""
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its model runners (``0``: the V1 runner, ``1``: Model Runner V2)."""
NO_STEER = "none"
"""The name a request asks for to be served unsteered, whatever the server's default."""


def configure(
    artifacts: Mapping[str, str | os.PathLike[str]],
    default: str | None = None,
    *,
    allow_opt_out: bool = False,
) -> None:
    """Name the artifacts requests may ask for, and the one (if any) that steers the requests
    that name none, in this process's environment (which vLLM's engine and worker processes
    inherit): call it before creating the engine. ``allow_opt_out``: a request may then ask
    for ``"none"`` and be served unsteered despite the default (refused otherwise)."""
    names = {str(k): str(Path(v).resolve()) for k, v in artifacts.items()}
    check_names(names, default)
    os.environ[ENV] = json.dumps(names)
    if default is None:
        os.environ.pop(DEFAULT_ENV, None)
    else:
        os.environ[DEFAULT_ENV] = default
    if allow_opt_out:
        os.environ[OPT_OUT_ENV] = "1"
    else:
        os.environ.pop(OPT_OUT_ENV, None)


def check_names(names: Collection[str], default: str | None) -> None:
    """Refuse an artifact named ``none`` (what a request says to opt out of the default) and a
    default the server does not serve."""
    from gss.errors import GSSError

    if NO_STEER in names:
        raise GSSError(
            f"an artifact is named {NO_STEER!r}, the name a request gives to be served "
            "unsteered: give it another name."
        )
    if default is not None and default not in names:
        raise GSSError(
            f"the default artifact (--default) {default!r} is not one the server serves "
            f"({sorted(names)}): name one of those, or leave --default out (requests that name "
            "no artifact are then not steered)."
        )


def default_name(vllm_config: Any = None) -> str | None:
    """The artifact that steers requests naming none: the engine's ``additional_config``
    ``gss_default``, else ``GSS_VLLM_DEFAULT``, else None (they are not steered)."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and extra.get(DEFAULT_KEY) is not None:
        return str(extra[DEFAULT_KEY])
    return os.environ.get(DEFAULT_ENV, "").strip() or None


def opt_out_allowed(vllm_config: Any = None) -> bool:
    """Whether a request may ask for ``"none"`` despite a default: the engine's
    ``additional_config`` ``gss_allow_opt_out`` (true), else ``GSS_VLLM_ALLOW_OPT_OUT=1``."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and OPT_OUT_KEY in extra:
        return extra[OPT_OUT_KEY] is True
    return os.environ.get(OPT_OUT_ENV, "").strip() == "1"


def opt_out_message(default: str) -> str:
    """Why a request asking for ``"none"`` is refused where a default steers every request."""
    return (
        f"the request asks to be served unsteered ({{{EXTRA_ARG!r}: {NO_STEER!r}}}), but this "
        f"server steers every request with {default!r} unless it names another artifact it "
        "serves: its operator did not allow opting out (gss serve --allow-opt-out)."
    )


def artifact_paths(vllm_config: Any = None) -> dict[str, str]:
    """The {name: directory} requests may ask for: ``GSS_VLLM_ARTIFACTS``, then the engine's
    ``additional_config={"gss_artifacts": {...}}`` (``--additional-config`` of ``vllm serve``),
    which wins for a name in both."""
    out: dict[str, str] = {}
    raw = os.environ.get(ENV, "").strip()
    if raw.startswith("{"):
        out.update({str(k): str(v) for k, v in json.loads(raw).items()})
    elif raw:
        for item in raw.split(","):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"{ENV} entries are name=directory, got {item!r}")
            out[name.strip()] = path.strip()
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get(CONFIG_KEY), dict):
        out.update({str(k): str(v) for k, v in extra[CONFIG_KEY].items()})
    return out


def steer_name(params: Any) -> str | None:
    """The artifact name a request's SamplingParams ask for (None: not steered)."""
    extra = getattr(params, "extra_args", None) or {}
    name = extra.get(EXTRA_ARG)
    return None if name is None else str(name)


def unknown_name_message(name: str, names: Sequence[str]) -> str:
    """Why a request asking for the artifact ``name`` is refused, where ``names`` are served."""
    served = f"the engine serves {sorted(names)}" if names else "the engine serves none"
    return (
        f"the request asks for the gss artifact {name!r} (extra_args / vllm_xargs "
        f"{{{EXTRA_ARG!r}: ...}}), but {served}: ask for one of those, or for {NO_STEER!r} "
        "(not steered)."
    )


def triton_setting(environ: Mapping[str, str]) -> str:
    """``GSS_VLLM_TRITON`` as ``0``, ``1`` or ``auto`` (unset); anything else is refused."""
    wanted = environ.get(TRITON_ENV, "auto").strip().lower()
    if wanted not in ("0", "1", "auto"):
        from gss.errors import GSSError

        raise GSSError(
            f"{TRITON_ENV}={wanted!r}: give 0 (the steer as torch's ops), 1 (as gss's Triton "
            "kernel) or auto (the kernel on CUDA), or unset it."
        )
    return wanted
