"""ringkv.trainer: a stock transformers.Trainer and TRL's SFTTrainer, DPOTrainer and GRPOTrainer on
a dp=2 x sp=2 gloo world
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
BETA = 0.5  # DPOConfig.beta of tests/trainer_cases.py's run_dpo


def _launch(tmp, dp, sp, kinds, *extra):
    """``trainer_cases.py`` under torchrun on dp * sp ranks and in one unpatched process, started
    together; their JSON summaries."""
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
            str(dp * sp),
            CASES,
            "--dp",
            str(dp),
            "--sp",
            str(sp),
            "--kinds",
            kinds,
            "--out",
            str(tmp / "ring.json"),
            *extra,
        ],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ref = subprocess.run(
        [
            sys.executable,
            CASES,
            "--dp",
            str(dp),
            "--kinds",
            kinds,
            "--out",
            str(tmp / "ref.json"),
            *extra,
        ],
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
        ring, ref = json.load(f), json.load(g)
    ring["dir"] = tmp  # where DPO's final parameters are
    return ring, ref


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The dp=2 x sp=2 run (torchrun, 4 ranks) and the one-process reference, started together;
    both run Trainer then (when trl is installed) SFTTrainer with packing, DPOTrainer (sigmoid,
    then the other supported loss types summed) and GRPOTrainer (grpo, dr_grpo, dapo)."""
    grpo = "grpo,grpo_dr,grpo_dapo"
    kinds = f"trainer,sft,dpo,dpo_more,{grpo}" if _have("trl") and _have("datasets") else "trainer"
    return _launch(tmp_path_factory.mktemp("trainer"), 2, 2, kinds)


@pytest.fixture(scope="module")
def runs_sp3(tmp_path_factory):
    """DPOTrainer with loss_type='ipo' and GRPOTrainer with loss_type='bnpo' and TRL's sampling
    generate at temperature 0.8 on dp=1 x sp=3 (an odd group) against one process."""
    if not (_have("trl") and _have("datasets")):
        pytest.skip("needs trl and datasets")
    extra = (
        "--dpo-loss",
        "ipo",
        "--grpo-loss",
        "bnpo",
        "--grpo-sample",
        "--grpo-temperature",
        "0.8",
    )
    return _launch(tmp_path_factory.mktemp("trainer_sp3"), 1, 3, "dpo,grpo", *extra)


def _have(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _check(ring, ref, metrics=("loss", "grad_norm"), total=8, scale=None):
    """``scale(key, step)``: what a difference is relative to (default: the metric itself)."""
    assert len(ref["steps"]) == 3 and [s["step"] for s in ring["steps"]] == [
        s["step"] for s in ref["steps"]
    ]
    for a, b in zip(ring["steps"], ref["steps"]):
        for key in metrics:
            mag = abs(b[key]) if scale is None else scale(key, b)
            assert abs(a[key] - b[key]) <= TOL * mag, (key, a, b)
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
    assert ring["total_batch"] == total  # per device 2 x accumulation 2 x dp
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


def _check_params(run_dir):
    """The final parameters of the patched run and of the unpatched one, within TOL."""
    import torch

    a, b = torch.load(run_dir / "params-ring.pt"), torch.load(run_dir / "params-ref.pt")
    assert a.keys() == b.keys()
    for name in b:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= TOL * b[name].abs().max().item(), (name, diff)


def _check_dpo(ring, ref, out_dir, dp, sp, kind="dpo"):
    """Every logged DPO metric, the grad norms and the final parameters (SGD) within TOL."""

    from tests.trainer_cases import DPO_KEYS

    def scale(key, step):
        # rewards are beta * (logp - logp_ref), differences of two float32 sums over the tokens:
        # relative to the terms (float32 rounding of a sum of ~30 is ~2e-6), not to the difference
        if key.startswith("rewards/") and key != "rewards/accuracies":
            logps = max(abs(step["logps/chosen"]), abs(step["logps/rejected"]))
            return max(abs(step[key]), BETA * logps)
        if key.startswith("logits/"):  # means over the vocabulary of logits of order 1: ~0.01
            return max(abs(step[key]), 0.1)
        return abs(step[key])

    metrics = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", *DPO_KEYS)
    _check(ring, ref, metrics, total=2 * 2 * dp, scale=scale)
    assert ring["ref_patched"] == sp and ref["ref_patched"] is None  # the reference patched too
    assert ref["steps"][0]["rewards/margins"] == 0  # step 1: policy == reference
    assert all(s["rewards/margins"] != 0 for s in ref["steps"][1:])  # then it moved
    _check_params(out_dir / kind)


@pytest.mark.slow
def test_dpo_trainer_dp2_sp2_matches_one_unpatched_process(runs):
    """DPOTrainer (loss_type='sigmoid', beta 0.5, SGD), 3 steps of 2 accumulated micro-batches of
    right-padded preference pairs of unequal lengths; the reference model passed unpatched
    (sp_trainer patches it). Loss, grad norm, TRL's rewards/*, logps/*, logits/*, entropy,
    mean_token_accuracy and num_tokens, and the final parameters."""
    ring, ref = runs
    if "dpo" not in ring:
        pytest.skip("needs trl and datasets")
    _check_dpo(ring["dpo"], ref["dpo"], ring["dir"], dp=2, sp=2)


@pytest.mark.slow
def test_dpo_trainer_other_loss_types_dp2_sp2_match_one_unpatched_process(runs):
    """hinge, sigmoid_norm, apo_zero, apo_down, discopop, nca_pair and sppo_hard, summed (one
    run; a wrong term shows in the loss, the grad norm and the parameters)."""
    ring, ref = runs
    if "dpo_more" not in ring:
        pytest.skip("needs trl and datasets")
    _check_dpo(ring["dpo_more"], ref["dpo_more"], ring["dir"], dp=2, sp=2, kind="dpo_more")


@pytest.mark.slow
def test_dpo_trainer_ipo_dp1_sp3_matches_one_unpatched_process(runs_sp3):
    """loss_type='ipo' (per-token length normalisation) on an SP group of 3 ranks."""
    ring, ref = runs_sp3
    _check_dpo(ring["dpo"], ref["dpo"], ring["dir"], dp=1, sp=3)


def _check_grpo(ring, ref, out_dir, dp, sp, kind="grpo"):
    """Every logged GRPO metric, the grad norms, the step accounting and the final parameters (SGD)
    within TOL; the completions, rewards and advantages must have been worth comparing."""

    from tests.trainer_cases import GRPO_KEYS

    # the loss is a sum of terms of order 1 (unit-std advantages) and about 0 at step 1
    def scale(key, step):
        return max(abs(step[key]), 0.1) if key in ("loss", "kl") else abs(step[key])

    metrics = ("loss", "grad_norm", "entropy", "num_tokens", *GRPO_KEYS)
    assert [s["step"] for s in ring["steps"]] == [s["step"] for s in ref["steps"]] == [1, 2]
    for a, b in zip(ring["steps"], ref["steps"]):
        for key in metrics:
            assert abs(a[key] - b[key]) <= TOL * scale(key, b), (key, a, b)
    for key in ("global_step", "epoch", "max_steps", "batches_per_epoch", "total_batch"):
        assert ring[key] == ref[key], (key, ring[key], ref[key])
    assert ring["tokens_seen"] == ref["tokens_seen"] > 0  # TRL counts prompt + completion tokens
    assert ring["total_batch"] == 2 * 2 * dp and ring["wrapped"] == "DistributedDataParallel"
    assert ring["ref_patched"] == sp and ref["ref_patched"] is None  # TRL's reference, patched
    first, second = ref["steps"]
    assert first["reward_std"] > 0.1 and first["frac_reward_zero_std"] < 1  # advantages not 0
    assert first["kl"] == 0 and second["kl"] > 1e-3  # the policy moved away from the reference
    assert any(s["completions/clipped_ratio"] < 1 for s in ref["steps"])  # some ended with EOS
    _check_params(out_dir / kind)


@pytest.mark.slow
def test_grpo_trainer_dp2_sp2_matches_one_unpatched_process(runs):
    """GRPOTrainer (loss_type='grpo', beta 0.2, SGD), 2 steps of 2 accumulated micro-batches, 2
    generations per prompt: completions from tests/trainer_cases.py's forced_rollout (a first token
    fixed per generation, then the patched model's greedy generate over left-padded prompts),
    rewards grouped over the replicas, TRL's reference patched; loss, grad norm, kl, entropy,
    rewards, completion lengths, num_tokens and the final parameters."""
    ring, ref = runs
    if "grpo" not in ring:
        pytest.skip("needs trl and datasets")
    _check_grpo(ring["grpo"], ref["grpo"], ring["dir"], dp=2, sp=2)


@pytest.mark.slow
def test_grpo_trainer_dr_grpo_dp2_sp2_matches_one_unpatched_process(runs):
    """loss_type='dr_grpo' (a sum over the batch's tokens over B x max_completion_length)."""
    ring, ref = runs
    if "grpo_dr" not in ring:
        pytest.skip("needs trl and datasets")
    _check_grpo(ring["grpo_dr"], ref["grpo_dr"], ring["dir"], dp=2, sp=2, kind="grpo_dr")


@pytest.mark.slow
def test_grpo_trainer_dapo_dp2_sp2_matches_one_unpatched_process(runs):
    """loss_type='dapo' (GRPOConfig's default: the generation batch's tokens over the processes,
    here the replicas, normalise)."""
    ring, ref = runs
    if "grpo_dapo" not in ring:
        pytest.skip("needs trl and datasets")
    _check_grpo(ring["grpo_dapo"], ref["grpo_dapo"], ring["dir"], dp=2, sp=2, kind="grpo_dapo")


@pytest.mark.slow
def test_grpo_trainer_bnpo_sampling_dp1_sp3_matches_one_unpatched_process(runs_sp3):
    """loss_type='bnpo' (a token mean per micro-batch) on an SP group of 3 ranks, completions from
    TRL's own generate call with do_sample=True at temperature 0.8 (the group's ranks draw alike:
    seed per replica; TRL's head and the patched per_token forward divide the logits by 0.8), one
    generation for both micro-batches of a step (steps_per_generation = 2: TRL's shuffle)."""
    ring, ref = runs_sp3
    _check_grpo(ring["grpo"], ref["grpo"], ring["dir"], dp=1, sp=3)


def test_grpo_refusals(tmp_path):
    """Options the patched GRPO path cannot honour: ValueError at construction naming them."""
    import copy

    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import GRPOConfig, GRPOTrainer

    import ringkv.hf
    from ringkv.trainer import sp_trainer
    from tests.models import tiny_model
    from tests.trainer_cases import grpo_prompts, grpo_reward, tiny_tokenizer

    data = datasets.Dataset.from_list(grpo_prompts(4))
    model = ringkv.hf.patch_model(tiny_model("llama", 0))  # refused before TRL touches it
    cases = [  # (GRPOConfig options, trainer arguments, what the error names)
        (dict(loss_type="luspo"), {}, "loss_type='luspo'"),
        (dict(loss_type="cispo"), {}, "cispo"),
        (dict(loss_type="sapo"), {}, "sapo"),
        (dict(use_vllm=True), {}, "use_vllm"),
        (dict(use_transformers_continuous_batching=True), {}, "continuous_batching"),
        (dict(use_liger_kernel=True), {}, "use_liger_kernel"),
        (dict(cast_lm_head_to_fp32=True), {}, "cast_lm_head_to_fp32"),
        (dict(temperature=0.0), {}, "temperature=0.0"),
        (dict(top_entropy_quantile=0.5), {}, "top_entropy_quantile"),
        (dict(log_completions=True), {}, "log_completions"),
        ({}, dict(tools=[grpo_reward]), "tools"),
        ({}, dict(model="some/model"), "model name"),
    ]
    base = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        use_cpu=True,
        report_to="none",
        bf16=False,
        num_generations=2,
        per_device_train_batch_size=2,
        loss_type="grpo",
    )
    for options, extra, match in cases:
        args = copy.copy(base)  # one GRPOConfig (about 1 s each): the options set on copies
        for name, value in options.items():
            setattr(args, name, value)
        kw = dict(
            model=model,
            reward_funcs=grpo_reward,
            args=args,
            train_dataset=data,
            processing_class=tiny_tokenizer(words=True),
        )
        with pytest.raises(ValueError, match=match):
            sp_trainer(GRPOTrainer)(**{**kw, **extra})


def test_dpo_refusals(tmp_path):
    """Options the patched DPO path cannot honour: ValueError at construction naming them."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import DPOConfig, DPOTrainer

    import ringkv.hf
    from ringkv.trainer import sp_trainer
    from tests.models import tiny_model
    from tests.trainer_cases import preference_rows, tiny_tokenizer

    data = datasets.Dataset.from_list(preference_rows(4))
    cases = [  # (DPOConfig options, trainer arguments, what the error names)
        (dict(loss_type=["sft"]), {}, "loss_type"),
        (dict(loss_type=["sigmoid", "bco_pair"]), {}, "bco_pair"),
        (dict(loss_type=["aot"]), {}, "aot"),
        (dict(use_weighting=True), {}, "use_weighting"),
        (dict(precompute_ref_log_probs=True), {}, "precompute_ref_log_probs"),
        (dict(use_liger_kernel=True), {}, "use_liger_kernel"),
        ({}, dict(compute_metrics=lambda p: {}), "compute_metrics"),
    ]
    for options, extra, match in cases:
        args = DPOConfig(
            output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none", **options
        )
        with pytest.raises(ValueError, match=match):
            sp_trainer(DPOTrainer)(
                model=ringkv.hf.patch_model(tiny_model("llama", 0)),
                ref_model=tiny_model("llama", 0),
                args=args,
                train_dataset=data,
                processing_class=tiny_tokenizer(words=True),
                **extra,
            )


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


def test_dpo_evaluate_matches_unpatched_single_process(tmp_path):
    """evaluate() of sp_trainer(DPOTrainer) on one process (a group of 1: the same hooks, per_token
    forward and gather) against TRL's own: eval-mode per_token forwards through the mixin's
    loss-only prediction_step. fp32 (bf16=False, as the torchrun cases: 1e-5 needs float32; bf16
    autocast runs too, tests/test_hf_train.py's autocast test)."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import transformers
    from trl import DPOConfig, DPOTrainer

    import ringkv.hf
    from ringkv.trainer import sp_trainer
    from tests.models import tiny_model
    from tests.trainer_cases import preference_rows, tiny_tokenizer

    transformers.utils.logging.set_verbosity_error()
    data = datasets.Dataset.from_list(preference_rows(6, seed=5))
    results = []
    for patched in (False, True):
        model = tiny_model("llama", 0)
        args = DPOConfig(
            output_dir=str(tmp_path / str(patched)),
            per_device_eval_batch_size=3,
            bf16=False,
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
        )
        cls = sp_trainer(DPOTrainer) if patched else DPOTrainer
        trainer = cls(
            model=ringkv.hf.patch_model(model) if patched else model,
            ref_model=tiny_model("llama", 0),
            args=args,
            train_dataset=data,
            eval_dataset=data,
            processing_class=tiny_tokenizer(words=True),
        )
        results.append(trainer.evaluate())
    ref, got = results
    for key in ("eval_loss", "eval_logps/chosen", "eval_logps/rejected", "eval_entropy"):
        assert abs(got[key] - ref[key]) <= TOL * abs(ref[key]), (key, got, ref)
    assert got["eval_rewards/margins"] == 0 and got["eval_rewards/accuracies"] == 0
