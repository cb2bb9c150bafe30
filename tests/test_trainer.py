"""ringkv.trainer: a stock transformers.Trainer and TRL's SFTTrainer on a dp=2 x sp=2 gloo world
(real torchrun processes: Trainer and accelerate read RANK/WORLD_SIZE and wrap the model in DDP over
the world themselves) against one unpatched process on the same data with the same
gradient_accumulation_steps=2: every step's logged loss and grad norm within 1e-5 relative, and the
same step/epoch accounting. The runs are in tests/trainer_cases.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = os.path.join(ROOT, "tests", "trainer_cases.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The dp=2 x sp=2 run (torchrun, 4 ranks) and the one-process reference, started together;
    both run Trainer then (when trl is installed) SFTTrainer with packing."""
    kinds = "trainer,sft" if _have("trl") and _have("datasets") else "trainer"
    tmp = tmp_path_factory.mktemp("trainer")
    env = dict(
        os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RINGKV_TIMEOUT_S="120"
    )
    ring = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            CASES,
            "--dp",
            "2",
            "--sp",
            "2",
            "--kinds",
            kinds,
            "--out",
            str(tmp / "ring.json"),
        ],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ref = subprocess.run(
        [sys.executable, CASES, "--dp", "2", "--kinds", kinds, "--out", str(tmp / "ref.json")],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        ring_out, _ = ring.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        ring.kill()
        ring_out, _ = ring.communicate()
        pytest.fail(f"the dp x sp run did not finish in 300 s:\n{ring_out[-6000:]}")
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-6000:]
    assert ring.returncode == 0, ring_out[-6000:]
    with open(tmp / "ring.json") as f, open(tmp / "ref.json") as g:
        return json.load(f), json.load(g)


def _have(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _check(ring, ref, metrics=("loss", "grad_norm")):
    assert len(ref["steps"]) == 3 and [s["step"] for s in ring["steps"]] == [
        s["step"] for s in ref["steps"]
    ]
    for a, b in zip(ring["steps"], ref["steps"]):
        for key in metrics:
            assert abs(a[key] - b[key]) <= TOL * abs(b[key]), (key, a, b)
    assert ring["tokens_seen"] > 0
    for key in (
        "global_step",
        "epoch",
        "max_steps",
        "batches_per_epoch",
        "total_batch",
        "fsdp",
        "tokens_seen",
    ):
        assert ring[key] == ref[key], (
            key,
            ring[key],
            ref[key],
        )  # dp replicas' batches, not the world's
    assert ring["total_batch"] == 2 * 2 * 2  # per device 2 x accumulation 2 x dp 2
    assert (
        ring["wrapped"] == "DistributedDataParallel" and ref["wrapped"] != ring["wrapped"]
    )  # DDP over the world
    assert len({round(s["loss"], 4) for s in ring["steps"]}) == 3  # the steps saw different data


@pytest.mark.slow
def test_trainer_dp2_sp2_matches_one_unpatched_process(runs):
    """Rows of 22 tokens (zigzag pads to 24) with -100 on random prefixes (unequal label counts over
    rows, replicas and micro-batches: num_items_in_batch decides the weighting), one epoch of 3
    steps."""
    ring, ref = runs
    _check(ring["trainer"], ref["trainer"])
    assert ring["trainer"]["epoch"] == 1.0 and ring["trainer"]["batches_per_epoch"] == 6


@pytest.mark.slow
def test_sft_trainer_packing_dp2_sp2_matches_one_unpatched_process(runs):
    """SFTTrainer, packing=True (best-fit packing, padding-free: position_ids, cu_seq_lens,
    seq_idx), max_steps 3: loss and grad norm, and TRL's entropy, mean_token_accuracy and
    num_tokens (from the chunked kernel's per-token values of every rank's shard)."""
    ring, ref = runs
    if "sft" not in ring:
        pytest.skip("needs trl and datasets")
    metrics = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
    _check(ring["sft"], ref["sft"], metrics)
    assert any(s["mean_token_accuracy"] > 0 for s in ref["sft"]["steps"])  # some hits to compare


def test_layout_errors(world):
    """sp_layout: a patch over the mesh's sp dim, over another dim (with the mesh: ValueError on
    every rank; alone: a valid (dp, sp) tiling), and unequal groups (ValueError on every rank)."""
    res = world.check("tests.trainer_cases:layout_errors", 4)
    for rank, r in enumerate(res):
        assert tuple(r["sp"]) == (2, 2, rank // 2)
        assert r["dp_with_mesh"].startswith("ValueError") and "mesh_dim='sp'" in r["dp_with_mesh"]
        assert tuple(r["dp_alone"]) == (2, 2, rank % 2)
        assert r["unequal"].startswith("ValueError") and "equal, disjoint" in r["unequal"]


def test_single_process_errors():
    from transformers import Trainer

    import ringkv.hf
    from ringkv.trainer import SPTrainerMixin, sp_layout, sp_trainer
    from tests.models import tiny_model

    with pytest.raises(TypeError, match="Trainer subclass"):
        sp_trainer(object)
    cls = sp_trainer(Trainer)
    assert issubclass(cls, SPTrainerMixin) and issubclass(cls, Trainer) and sp_trainer(cls) is cls
    with pytest.raises(ValueError, match="not patched"):
        sp_layout(tiny_model("llama", 0))
    with pytest.raises(ValueError, match="inputs='full'"):
        sp_layout(ringkv.hf.patch_model(tiny_model("llama", 0), inputs="shard"))
    assert sp_layout(ringkv.hf.patch_model(tiny_model("llama", 0))) == (1, 1, 0)


def test_sft_moe_load_balancing_loss_is_refused(tmp_path):
    """SFTTrainer adds an MoE model's load-balancing loss from the router logits, which a patched
    forward has for its shard only: refused at construction, naming router_aux_loss_coef."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import transformers
    from trl import SFTConfig, SFTTrainer

    import ringkv.hf
    from ringkv.trainer import sp_trainer
    from tests.trainer_cases import sft_documents, tiny_tokenizer

    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
    )
    model = ringkv.hf.patch_model(transformers.MixtralForCausalLM(config))
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        sp_trainer(SFTTrainer)(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(sft_documents(4)),
            processing_class=tiny_tokenizer(),
        )
