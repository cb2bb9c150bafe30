"""The package's shape, held (issue #55): no import circle inside ringkv, no package importing one
above it in docs/design.md's layer order, no function over 100 lines outside Triton kernels, no
`from x import _name` across modules. Read from the source text (`tests/structure.py`); each rule
is also run on a small planted tree, so a checker that stopped seeing would fail here too."""

import pytest

from tests import structure

MODS = structure.load()


def test_every_package_has_a_layer():
    """A new package must be placed in the layer order before it can be checked."""
    assert {m.package for m in MODS.values()} <= set(structure.LAYER)


def test_no_import_circle():
    assert structure.circles(MODS) == []


def test_no_upward_import():
    assert structure.upward(MODS) == []


def test_no_private_import_across_modules():
    assert structure.private_imports(MODS, across="module") == []


def test_no_long_function():
    fns = structure.functions(MODS)
    assert [f"{n} lines: {where}" for n, where, kernel in fns if n > 100 and not kernel] == []


@pytest.fixture
def planted(tmp_path):
    """A tree with one of each fault: engine <-> engine circle, cache importing engine (upward),
    a private import, a 101-line function, and a 120-line Triton kernel (allowed)."""
    pkg = tmp_path / "ringkv"
    for d in ("engine", "cache", "kernels"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "engine" / "b.py").write_text("from . import a\nB = 2\n")
    (pkg / "cache" / "c.py").write_text("from ..engine.a import A\nfrom ..kernels.k import _p\n")
    body = "".join(f"    x{i} = {i}\n" for i in range(99))
    (pkg / "kernels" / "k.py").write_text(
        "import triton\n_p = 0\n\ndef long():\n" + body + "    return 0\n\n"
        "@triton.jit\ndef kernel():\n" + body + body[:2000] + "    return 0\n"
    )
    return structure.load(pkg)


def test_the_checks_see_planted_faults(planted, monkeypatch):
    monkeypatch.setattr(structure, "ROOT", next(iter(planted.values())).path.parent)
    assert structure.circles(planted) == [["ringkv.engine.a", "ringkv.engine.b"]]
    assert [u.split(": ", 1)[1] for u in structure.upward(planted)] == [
        "cache imports ringkv.engine.a"
    ]
    assert [p.split(": ", 1)[1] for p in structure.private_imports(planted)] == [
        "_p from ringkv.kernels.k"
    ]
    fns = {where.split()[-1]: (n, kernel) for n, where, kernel in structure.functions(planted)}
    assert fns["long"] == (101, False)
    assert fns["kernel"][0] > 100 and fns["kernel"][1]


def test_report_runs():
    text = structure.report()
    assert "circles: " in text and "largest modules:" in text
