"""``ringkv.kernels`` has no import circles: its modules import each other (never the package's
``__init__``), the graph of their top-level imports is acyclic, and each module imports first
in a fresh state."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "ringkv" / "kernels"
PACKAGE = "__init__"


def _modules():
    return sorted(p.stem for p in KERNELS.glob("*.py"))


def _top_level(tree):
    """Statements run at import: the module body, through if/try/with blocks, not into defs."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, ()))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def imports_of(name: str, modules) -> set:
    """Modules of the package that ``name`` imports at top level (``PACKAGE``: the package
    itself)."""
    out = set()
    for node in _top_level(ast.parse((KERNELS / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[:2] == ["ringkv", "kernels"]:
                    out.add(parts[2] if len(parts) > 2 else PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[:2] != ["ringkv", "kernels"]:
                    continue
                rest = parts[2:]
            elif node.level == 1:
                rest = node.module.split(".") if node.module else []
            else:  # from .. import kernels / from ..kernels import X
                parts = (node.module or "").split(".")
                if parts[:1] == ["kernels"]:
                    rest = parts[1:]
                elif any(a.name == "kernels" for a in node.names):
                    out.add(PACKAGE)
                    continue
                else:
                    continue
            if rest:
                out.add(rest[0])
            else:  # from . import X: a submodule, or a name of the package's __init__
                out.update(a.name if a.name in modules else PACKAGE for a in node.names)
    out.discard(name)
    return out


def test_no_module_imports_the_package_and_the_graph_is_acyclic():
    modules = _modules()
    graph = {m: imports_of(m, modules) for m in modules}
    assert not [m for m, deps in graph.items() if m != PACKAGE and PACKAGE in deps], graph
    assert (
        graph["paged"] >= {"paged_base", "paged_torch"} and "dispatch" in graph[PACKAGE]
    )  # the parser sees them
    state, stack = {}, []

    def visit(m):  # depth-first search; a module met again while on the stack closes a circle
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != "open", (
                f"import circle: {' -> '.join(stack[stack.index(d) :] + [d])}"
            )
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in modules:
        if m not in state:
            visit(m)


def test_every_module_imports_first():
    """Each module imported with no ``ringkv`` module loaded before it (one interpreter; torch and
    triton stay loaded). Triton modules may fail with ImportError only where triton is missing."""
    script = """
import importlib, importlib.util, json, sys, types
pkg = types.ModuleType("ringkv"); pkg.__path__ = [sys.argv[1]]
result = {}
for m in sys.argv[2:]:
    for name in [n for n in sys.modules if n == "ringkv" or n.startswith("ringkv.")]:
        del sys.modules[name]
    sys.modules["ringkv"] = pkg
    try:
        importlib.import_module("ringkv.kernels" + ("" if m == "__init__" else "." + m))
        result[m] = "ok"
    except ImportError as e:
        no_triton = m.startswith("triton") and importlib.util.find_spec("triton") is None
        result[m] = "ok" if no_triton else repr(e)
    except Exception as e:
        result[m] = repr(e)
print(json.dumps(result))
"""
    env = dict(os.environ)
    if not _cuda():
        env.setdefault("TRITON_INTERPRET", "1")
    r = subprocess.run(
        [sys.executable, "-c", script, str(KERNELS.parent), *_modules()],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {m: "ok" for m in _modules()}, result


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
