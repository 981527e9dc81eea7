"""The package's floors: each room (a subpackage or a top-level module of ``gss``) imports only
rooms on floors below its own, so the code reads bottom-up in the order data flows and no two
rooms need each other (docs/architecture.md). Read from the source (every ``import``, at the
top of a file or inside a function), nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gss"

# ground floor first; a room may import the rooms of every floor below its own
FLOORS: list[set[str]] = [
    {"errors", "_startup", "_version", "file_names", "distributed"},  # import nothing of gss
    {"config", "data", "report"},
    {"hf"},  # models, blocks, forwards, the Hub
    {"steering"},  # a gated steer on a block
    {"signal"},  # the memorization signal
    {"statistics"},  # M and Sigma_gen from a forward pass
    {"artifact"},  # the saved steer: files, fingerprint, card, stack
    {"solve", "data_sources"},
    {"calibrate", "layer_scan", "evaluate", "inference"},
    {"audit"},
    {"protect"},
    {"__init__"},  # the package face: the public names
    {"serving"},
    {"cli"},
    {"__main__"},
]
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0].removesuffix(".py")


def _imported_rooms(path: Path) -> list[tuple[int, str]]:
    """(line, room) for every import of a gss module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        modules: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        for module, names in modules:
            parts = module.split(".")
            if parts[0] != "gss":
                continue
            if len(parts) > 1:
                found.append((node.lineno, parts[1]))
                continue
            # `import gss` or `from gss import x`: a room by name, else the package face
            rooms = [n for n in names if n in FLOOR and n != "__init__"]
            found += [(node.lineno, r) for r in rooms or ["__init__"]]
    return found


def test_every_room_has_a_floor():
    rooms = {_room(p) for p in PACKAGE.rglob("*.py")}
    assert rooms - set(FLOOR) == set(), "give each new room of src/gss a floor here"
    assert set(FLOOR) - rooms == set(), "a room here that src/gss no longer has"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_imports_only_go_down(path):
    room = _room(path)
    upward = [
        f"{path.relative_to(PACKAGE)}:{line} imports {target} (floor {FLOOR[target]}) from "
        f"{room} (floor {FLOOR[room]})"
        for line, target in _imported_rooms(path)
        if target != room and FLOOR[target] >= FLOOR[room]
    ]
    assert upward == []


MAX_LINES = 80  # a function's lines, from its `def` line to its last (decorators not counted)


def test_no_function_is_over_80_lines():
    """Every function of `gss` reads as its named steps (issue 71): one that grows past 80
    lines is split into them (private helpers, small dataclasses), not left to become one long
    function again. `gss.protect` and `gss.cli` were held to it first; now the whole package."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
                    long.append(f"{where} {node.name} ({lines} lines)")
    assert not long, f"functions of gss over {MAX_LINES} lines, to split into steps: {long}"
