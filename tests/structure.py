"""The package's shape, read from its source text (nothing of ringkv is imported).

`python -m tests.structure` prints the report the layout is judged by: module sizes, the
longest functions, import circles, upward imports across the layer order of docs/design.md,
and imports of another module's private names. `tests/test_structure.py` holds the rules.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ringkv"

# docs/design.md's layer order, bottom to top: a package may import its own layer and the ones
# below it, never one above. A name is a package of ringkv or a top-level module of it.
LAYERS = (
    ("kernels",),
    ("model", "cache", "memory"),
    ("sp",),
    ("parallel",),
    ("engine",),
    ("planner", "hf"),
    ("serve", "trainer", "trainer_dpo", "trainer_grpo"),
    ("__init__", "__main__"),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


@dataclass
class Module:
    name: str  # dotted: ringkv.engine.core
    path: pathlib.Path
    tree: ast.Module
    imports: list[tuple[str, list[str], int]] = field(default_factory=list)  # (target, names, line)

    @property
    def package(self) -> str:
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def load(root: pathlib.Path = ROOT) -> dict[str, Module]:
    """Every module of the package, parsed, with the ringkv modules each one imports."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            for target, names in _targets(mod, node, mods):
                mod.imports.append((target, names, node.lineno))
    return mods


def _targets(mod: Module, node: ast.AST, mods: dict[str, Module]):
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "ringkv":
                yield _known(alias.name, mods), []
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.name.split(".")
            base = base[: len(base) - node.level + (1 if mod.is_package else 0)]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        if src.split(".")[0] != "ringkv":
            return
        plain = []
        for alias in node.names:
            if f"{src}.{alias.name}" in mods:  # `from pkg import submodule`
                yield f"{src}.{alias.name}", []
            else:
                plain.append(alias.name)
        if plain or not node.names:
            yield _known(src, mods), plain


def _known(name: str, mods: dict[str, Module]) -> str:
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def package_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def circles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan), each sorted."""
    graph = {m: sorted({t for t, _, _ in mod.imports if t != m}) for m, mod in mods.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(out)


def upward(mods: dict[str, Module]) -> list[str]:
    """Imports from a package into one above it in LAYERS."""
    out = []
    for mod in mods.values():
        for target, _, line in mod.imports:
            a, b = package_of(mod.name), package_of(target)
            if LAYER[b] > LAYER[a]:
                out.append(f"{mod.path.relative_to(ROOT.parent)}:{line}: {a} imports {target}")
    return sorted(out)


def private_imports(mods: dict[str, Module], across: str = "package") -> list[str]:
    """`from x import _name` where x is another package (across="package") or module."""
    out = []
    for mod in mods.values():
        for target, names, line in mod.imports:
            other = package_of(target) != mod.package if across == "package" else target != mod.name
            for n in names:
                if other and n.startswith("_") and not n.startswith("__"):
                    out.append(f"{mod.path.relative_to(ROOT.parent)}:{line}: {n} from {target}")
    return sorted(out)


def _is_triton_kernel(fn: ast.AST) -> bool:
    """Decorated `@triton.jit` (or autotune/heuristics), or with kernels/triton_common's lazy
    `@jit`: a kernel is one body the compiler sees whole, so it is not held to the length rule."""
    for dec in getattr(fn, "decorator_list", []):
        call = dec.func if isinstance(dec, ast.Call) else dec
        name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "")
        if name in ("jit", "_jit", "autotune", "heuristics"):
            return True
    return False


def functions(mods: dict[str, Module]) -> list[tuple[int, str, bool]]:
    """(lines, "path:line name", is a Triton kernel) for every function, longest first."""
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                where = f"{mod.path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"
                out.append((node.end_lineno - start + 1, where, _is_triton_kernel(node)))
    return sorted(out, reverse=True)


def report() -> str:
    mods = load()
    sizes = sorted(
        (
            (len(m.path.read_text().splitlines()), str(m.path.relative_to(ROOT.parent)))
            for m in mods.values()
        ),
        reverse=True,
    )
    fns = [f for f in functions(mods) if not f[2]]
    lines = [f"modules: {len(mods)}, lines: {sum(s for s, _ in sizes)}", "largest modules:"]
    lines += [f"  {n:5d} {p}" for n, p in sizes[:12]]
    lines += [f"functions over 80 lines (not Triton kernels): {sum(n > 80 for n, _, _ in fns)}"]
    lines += [f"  {n:5d} {w}" for n, w, _ in fns[:12]]
    lines += [f"circles: {len(circles(mods))}"] + [f"  {' <-> '.join(c)}" for c in circles(mods)]
    lines += [f"upward imports: {len(upward(mods))}"] + [f"  {u}" for u in upward(mods)]
    for across in ("package", "module"):
        found = private_imports(mods, across)
        lines += [f"private imports across {across}s: {len(found)}"] + [f"  {p}" for p in found]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
