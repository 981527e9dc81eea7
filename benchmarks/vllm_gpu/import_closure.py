"""Static import closure of vLLM's offline-generate path: the third-party modules imported
when the modules below are imported (module level, outside functions and TYPE_CHECKING),
following vLLM's own imports transitively. No torch needed: it reads an unpacked wheel.

    python3 benchmarks/vllm_gpu/import_closure.py UNPACKED_WHEEL [--why] [more.vllm.modules]

Each third-party name is listed with a vLLM module that imports it, as ``hard`` (a chain of
unconditional imports reaches it), ``cond`` (some link is under an ``if`` or a ``try``: read
the condition) or ``lazy`` (imported inside a function of a module the closure loads).
``--why`` prints the chain of importers instead of the last one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

START = [
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.sampling_params",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.input_processor",
    "vllm.v1.engine.output_processor",
    "vllm.v1.request",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.platforms.cuda",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.sample.sampler",
]
LEVEL = ("hard", "cond", "lazy")
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def path_of(root: Path, mod: str) -> Path | None:
    p = root.joinpath(*mod.split("."))
    if (p / "__init__.py").exists():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").exists() else None


def imports(root: Path, mod: str, path: Path) -> list[tuple[str, int]]:
    """(module, level) of each import in ``mod``: 0 unconditional, 1 under if/try, 2 lazy."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[str, int]] = []

    def visit(body: list[ast.stmt], cond: int) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):  # lazy imports: absolute ones only
                    if isinstance(sub, ast.Import):
                        out.extend((a.name, 2) for a in sub.names)
                    elif isinstance(sub, ast.ImportFrom) and not sub.level and sub.module:
                        out.append((sub.module, 2))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body, 1)
                visit(node.orelse, 1)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse):
                    visit(block, 1)
                visit(node.finalbody, cond)
            elif isinstance(node, (ast.ClassDef, ast.With)):
                visit(node.body, cond)
            elif isinstance(node, ast.Import):
                out.extend((a.name, cond) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                name = node.module or ""
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                out.append((name, cond))
                # `from package import submodule`
                out.extend(
                    (f"{name}.{a.name}", cond)
                    for a in node.names
                    if path_of(root, f"{name}.{a.name}")
                )

    visit(ast.parse(path.read_text()).body, 0)
    return out


def main() -> None:
    root, args = Path(sys.argv[1]), sys.argv[2:]
    why = "--why" in args
    level: dict[str, int] = {}  # vllm module -> 0 hard, 1 cond
    parent: dict[str, str] = {}
    third: dict[str, tuple[int, str]] = {}  # third-party name -> (level, an importer)
    todo = [(m, 0, "") for m in START + [a for a in args if a != "--why"]]
    while todo:
        todo.sort(key=lambda t: -t[1])  # hard first
        mod, lvl, by = todo.pop()
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):  # parent packages are imported first
            m = ".".join(parts[:i])
            if level.get(m, 9) <= lvl or not (p := path_of(root, m)):
                continue
            level[m], parent[m] = lvl, by if m == mod else ".".join(parts[: i + 1])
            for name, kind in imports(root, m, p):
                top, how = name.split(".")[0], max(lvl, kind)
                if top == "vllm" and kind < 2:
                    todo.append((name, how, m))
                elif top not in ("", "vllm", *STDLIB) and third.get(top, (9, ""))[0] > how:
                    third[top] = (how, m)
    print(f"{sum(v == 0 for v in level.values())} vllm modules hard, {len(level)} in all")
    for top, (how, who) in sorted(third.items(), key=lambda kv: (kv[1][0], kv[0])):
        chain = [who]
        while why and parent.get(chain[-1]) and len(chain) < 30:
            chain.append(parent[chain[-1]])
        print(f"{LEVEL[how]:5s} {top:20s} {' <- '.join(chain)}")


if __name__ == "__main__":
    main()
