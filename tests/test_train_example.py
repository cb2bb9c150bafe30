"""examples/train_long_context.py under real torchrun: dp=2 x sp=2 training with transformers'
Trainer (ringkv.trainer.sp_trainer) on packed rows of the shipped text, 2 micro-batches per step,
against a plain
Trainer on the unpatched model in one process (--reference): per-step losses and gradient norms
within the example's tolerance. A tiny random Llama (UTF-8 byte tokens) stands in
for SmolLM2 so that the test stays short; docs/hf.md has the SmolLM2 run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_long_context.py")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.models import tiny_model

    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", 0, vocab_size=259).save_pretrained(
        str(path)
    )  # ids = byte + 3 (0 pad, 1 bos, 2 eos)
    return str(path)


def _table(stdout):
    """The comparison table's rows: (step, ring loss, reference loss, |diff|, rel, norm, ref norm,
    rel)."""
    return [
        tuple(float(x) for x in m.groups())
        for m in re.finditer(
            r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$",
            stdout,
            re.M,
        )
    ]


@pytest.mark.slow
def test_train_example_dp2_sp2_matches_the_unpatched_reference(tiny_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    steps = 3
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        EXAMPLE,
        "--model",
        tiny_dir,
        "--tokenizer",
        "bytes",
        "--dp",
        "2",
        "--sp",
        "2",
        "--seq",
        "48",
        "--batch",
        "2",
        "--ga",
        "2",
        "--steps",
        str(steps),
        "--lr",
        "1e-3",
        "--reference",
    ]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    rows = _table(p.stdout)
    assert [int(r[0]) for r in rows] == list(range(1, steps + 1)), p.stdout
    for _, ring, ref, diff, rel, norm, ref_norm, rel_norm in rows:
        assert abs(ring - ref) <= 1e-4 * abs(ref) and rel <= 1e-4, p.stdout
        assert abs(norm - ref_norm) <= 1e-4 * ref_norm and rel_norm <= 1e-4, p.stdout
    assert rows[-1][1] < rows[0][1], p.stdout  # lr 1e-3 on a random model: it learns
    assert re.search(r"max \|loss difference\| = \S+ .*tolerance 1e-04 relative: OK", p.stdout), (
        p.stdout
    )


def test_pack_rows_and_collate_follow_the_flattening_collator():
    """Rows of exactly ``seq`` tokens; a split document's tail starts the next row; position_ids
    restart per piece and labels are -100 at each piece's first token."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import train_long_context as ex
    finally:
        sys.path.pop(0)
    docs = [[10] * 5, [11] * 7, [12] * 3, [13] * 9]
    rows = ex.pack_rows(docs, 8, 5)
    assert [sum(len(p) for p in r) for r in rows] == [8] * 5
    assert rows[0] == [[10] * 5, [11] * 3] and rows[1] == [[11] * 4, [12] * 3, [13] * 1]
    assert rows[2] == [[13] * 8] and rows[3][0] == [10] * 5  # cycles over the documents
    b = ex.collate(rows[:2])
    assert b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == (2, 8)
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert b["position_ids"][1].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert b["labels"][1].tolist() == [-100, 11, 11, 11, -100, 12, 12, -100]
    tok = ex.ByteTokenizer()
    docs = ex.documents(ex.DATA, tok)
    assert len(docs) > 100 and all(d[-1] == tok.eos_token_id for d in docs)
    assert not any(
        bytes(t - 3 for t in d[:-1]).decode().startswith("#") for d in docs
    )  # the header is skipped
