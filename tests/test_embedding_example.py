"""examples/train_embedding.py under real torchrun: dp=1 x sp=2, 2 steps of InfoNCE over mean-pooled
embeddings of right-padded query/passage pairs on a tiny random ModernBERT (a local window of 16
tokens, rows of up to 48), against the unpatched model trained in one process on the same pairs
(--reference): the per-step losses agree to 1e-4 (relative)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_embedding.py")


def test_embedding_example_sp2_matches_the_unpatched_reference(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [EXAMPLE, "--sp", "2", "--seq", "48", "--batch", "3", "--steps", "2", "--reference"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    rows = [
        tuple(float(x) for x in m.groups())
        for m in re.finditer(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", p.stdout, re.M)
    ]
    assert [int(r[0]) for r in rows] == [0, 1], out
    for _, ring, ref, rel in rows:
        assert ref > 1e-3, out  # a loss that the comparison can see move
        assert abs(ring - ref) <= 1e-4 * ref and rel <= 1e-4, out
    assert "MATCH" in p.stdout, out
