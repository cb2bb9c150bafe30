"""The benchmarks never shadow an installed package.

``python benchmarks/X.py`` (and ``torchrun``) put the script's folder first on ``sys.path``, so a
module there named like an installed package replaces it for every import: ``benchmarks/kernels.py``
once hid HF's ``kernels`` package, which transformers >= 5.25 imports with its Llama model, and
every benchmark that loaded a model died with ``ImportError: cannot import name 'CUDAProperties'``.
Each script now takes ``benchmarks/`` off the path before its first import (its siblings are
imported as ``benchmarks.<name>``). This runs every script's import context the way Python starts
it and checks that no module of ``benchmarks/`` can be found by its bare name afterwards, then
builds a Llama model with transformers inside one such context.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "benchmarks"

CHECK = r"""
import importlib.util, os, runpy, sys

here = sys.argv[1]
scripts = sorted(f for f in os.listdir(here) if f.endswith(".py") and f != "__init__.py")
names = [f[:-3] for f in scripts]
clean = list(sys.path)
bad = []
for f in scripts:
    sys.path[:] = [here] + clean  # what `python benchmarks/<f>` starts with
    runpy.run_path(
        os.path.join(here, f), run_name="bench_import_context"
    )  # module level only: no main()
    for n in names:
        spec = importlib.util.find_spec(n) if n not in sys.modules else sys.modules[n].__spec__
        if (
            spec is not None
            and spec.origin
            and os.path.dirname(os.path.abspath(spec.origin)) == here
        ):
            bad.append(f"{f}: `import {n}` finds benchmarks/{n}.py")
    if f == "engine.py":
        kept = list(sys.path)  # a context that loads models: transformers is imported in it below
assert not bad, "\n".join(bad)
sys.path[:] = kept
import kernels  # HF's kernel hub, a dependency of transformers >= 5.25
from transformers import LlamaConfig, LlamaForCausalLM

model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
)
print("OK", os.path.dirname(kernels.__file__), sum(p.numel() for p in model.parameters()))
"""


def test_no_benchmark_module_shadows_an_installed_package():
    import importlib.util

    assert importlib.util.find_spec("kernels") is not None, (
        "HF's `kernels` is not installed (see constraints.txt)"
    )
    r = subprocess.run(
        [sys.executable, "-c", CHECK, str(HERE)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(HERE.parent),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("OK ") and str(HERE) not in line, line
