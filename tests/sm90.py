"""The Triton kernels compiled for sm_90 without a GPU (``compile_for_sm90``), every module's
script in ONE interpreter per test session.

Three modules check that their kernels get through the real compiler path (TTIR -> PTX -> cubin,
triton's bundled ptxas): ``test_triton.py``, ``test_triton_features.py`` and
``test_paged_features.py``, each with its own ``_COMPILE_SCRIPT``. Each script used to run in an
interpreter of its own (torch, triton and the kernels imported, ``tk.build()``, three times); on a
cold machine (no ``~/.triton`` cache) the first two took 78 s and 62 s of the suite. The first
test that asks runs all of them, one after the other, in one fresh interpreter (no
``TRITON_INTERPRET``: a crash fails only these tests) and keeps each script's output and
whether it ended without an exception; under pytest-xdist the workers share that run through a
folder of the test run (the other worker waits on its lock, then reads the outputs). Each test
still gets its own script's stdout (and a failure its own traceback) and makes its own checks.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the modules whose ``_COMPILE_SCRIPT`` the one run compiles
MODULES = ("tests.test_triton", "tests.test_triton_features", "tests.test_paged_features")

# Runs each script of the JSON file argv[1] ({name: source}) in fresh globals, as `python -c`
# would, and writes {name: [ok, stdout]} to argv[2]; a script that raises fails alone.
_RUNNER = r"""
import contextlib, io, json, sys, traceback
scripts, results = json.load(open(sys.argv[1])), {}
for name, source in scripts.items():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(source, "<" + name + ">", "exec"), {"__name__": "__main__"})
            ok = True
        except BaseException:
            traceback.print_exc(file=out)
            ok = False
    results[name] = [ok, out.getvalue()]
    print(name, "ok" if ok else "FAILED", flush=True)
json.dump(results, open(sys.argv[2], "w"))
"""

_done: dict = {}  # this process's results: {script source: [ok, stdout]}


def _shared_dir(tmp_path) -> Path:
    """A folder every pytest-xdist worker of this test run shares: the parent of the workers'
    base temp folders (``tmp_path`` is ``<basetemp>/<test>``); without xdist, this process's."""
    base = Path(tmp_path).parent if tmp_path is not None else Path(tempfile.mkdtemp())
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _run(scripts: dict, folder: Path, timeout: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        env["TMPDIR"] = scratch  # triton's PTX/cubin scratch files (it leaves them behind)
        (Path(scratch) / "scripts.json").write_text(json.dumps(scripts))
        out = Path(scratch) / "results.json"
        r = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(Path(scratch) / "scripts.json"), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if r.returncode != 0 or not out.exists():  # the interpreter itself died: every script fails
            why = r.stdout[-2000:] + r.stderr[-4000:]
            return {s: [False, why] for s in scripts.values()}
        return {scripts[name]: v for name, v in json.loads(out.read_text()).items()}


def compile_for_sm90(script: str, tmp_path=None, timeout: int = 300) -> str:
    """``script``'s stdout, run in a fresh interpreter without ``TRITON_INTERPRET`` together with
    the other modules' compile scripts (once per test run); an assertion error with its output
    when it raised. ``timeout`` (per script): the run of n scripts gets n times the largest of it
    and 400 s (the three used to get 300, 300 and 600 s). A script that is none of ``MODULES``'
    runs alone."""
    if script not in _done:
        scripts = {}
        for m in MODULES:
            try:
                scripts[m] = importlib.import_module(m)._COMPILE_SCRIPT
            except (Exception, pytest.skip.Exception):  # a module that skips itself here
                continue
        if script not in scripts.values():
            scripts = {"script": script}
        folder = _shared_dir(tmp_path)
        saved = folder / "ringkv-sm90.json"
        with open(folder / "ringkv-sm90.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            known = json.loads(saved.read_text()) if saved.exists() else {}
            if script not in known:
                known.update(_run(scripts, folder, max(400, timeout) * len(scripts)))
                saved.write_text(json.dumps(known))
        _done.update(known)
    ok, stdout = _done[script]
    assert ok, stdout[-6000:]
    return stdout
