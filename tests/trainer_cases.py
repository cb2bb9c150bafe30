"""Trainer / SFTTrainer / DPOTrainer / GRPOTrainer runs for tests/test_trainer.py, one script for
both sides of the comparison.

    # sp_trainer, patched model
    torchrun --nproc-per-node 4 tests/trainer_cases.py --dp 2 --sp 2 --out ring.json
    # one unpatched process
    python tests/trainer_cases.py --dp 2 --out ref.json

Both build the same tiny random model and the same data. The distributed run gives each replica
``--batch`` rows per micro-batch; the reference emulates the ``dp`` replicas with ``dp * batch``
rows per micro-batch (accelerate's BatchSamplerShard hands replica ``d`` the ``d``-th of every
``dp`` consecutive batches of the same sampler order, so the union of a micro-batch is the same
rows), with the same ``gradient_accumulation_steps``. Rank 0 (or the reference) writes, per kind,
the logged ``loss`` and ``grad_norm`` of every step (SFTTrainer: also ``entropy``,
``mean_token_accuracy`` and ``num_tokens``; DPO's and GRPO's metrics, ``DPO_KEYS`` and
``GRPO_KEYS``) and the step/epoch accounting; DPO and GRPO also save the final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trainer_rows(n: int, length: int, seed: int = 1):
    """``n`` rows of ``length`` tokens; labels -100 on a random prefix (0..length/2), so that the
    label counts differ between rows, replicas and micro-batches (num_items_in_batch matters)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(3, 128) for _ in range(length)]
        cut = rng.randrange(0, length // 2 + 1)
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    return rows


def sft_documents(n: int, seed: int = 2):
    rng = random.Random(seed)
    return [
        {"input_ids": [rng.randrange(3, 128) for _ in range(rng.randrange(3, 21))]}
        for _ in range(n)
    ]


def preference_rows(n: int, seed: int = 3):
    """``n`` text preference pairs over the word-level vocabulary of ``tiny_tokenizer(words=True)``:
    prompts of 2..9 words, chosen and rejected completions of 1..8 words ending in ``</s>`` (TRL
    adds no other EOS), so the rows of a batch differ in length (right padding, unequal completion
    counts: IPO's length normalisation and the pad handling matter)."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(f"t{rng.randrange(3, 128)}" for _ in range(rng.randrange(lo, hi + 1)))

    return [
        {
            "prompt": words(2, 9),
            "chosen": " " + words(1, 8) + " </s>",
            "rejected": " " + words(1, 8) + " </s>",
        }
        for _ in range(n)
    ]


def tiny_tokenizer(words: bool = False):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 128)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    if words:  # text split on whitespace (DPOTrainer tokenizes text)
        from tokenizers.pre_tokenizers import WhitespaceSplit

        tokenizer.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    tok.pad_token, tok.bos_token, tok.eos_token = "<pad>", "<s>", "</s>"
    return tok


def build_model(arch: str, patch: bool, sp: int, layout: str):
    from tests.models import tiny_model

    model = tiny_model(arch, 0).train()
    mesh = None
    if patch:
        import ringkv.hf
        from torch.distributed.device_mesh import init_device_mesh

        world = int(os.environ["WORLD_SIZE"])
        mesh = init_device_mesh("cpu", (world // sp, sp), mesh_dim_names=("dp", "sp"))
        ringkv.hf.patch_model(model, group=mesh, mesh_dim="sp", layout=layout)
    return model, mesh


def common_args(a, out_dir, batch):
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=a.ga,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=a.seed,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        use_cpu=True,
        ddp_backend="gloo" if a.sp else None,
        include_num_input_tokens_seen="all",
    )


def run_trainer(a, out_dir):
    from transformers import Trainer, TrainingArguments, default_data_collator

    from ringkv.trainer import sp_trainer

    patched = a.sp is not None
    model, mesh = build_model(a.arch, patched, a.sp or 1, a.layout)
    batch = a.batch if patched else a.batch * a.dp
    args = TrainingArguments(num_train_epochs=1, **common_args(a, out_dir, batch))
    cls = sp_trainer(Trainer) if patched else Trainer
    kw = {"sp_mesh": mesh} if patched else {}
    trainer = cls(
        model=model,
        args=args,
        train_dataset=trainer_rows(a.rows, a.length),
        data_collator=default_data_collator,
        **kw,
    )
    trainer.train()
    return trainer


def run_sft(a, out_dir):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from ringkv.trainer import sp_trainer

    patched = a.sp is not None
    model, mesh = build_model(a.arch, patched, a.sp or 1, a.layout)
    batch = a.batch if patched else a.batch * a.dp
    args = SFTConfig(
        packing=True,
        max_length=a.length,
        max_steps=a.steps,
        dataset_num_proc=None,
        **common_args(a, out_dir, batch),
    )
    cls = sp_trainer(SFTTrainer) if patched else SFTTrainer
    kw = {"sp_mesh": mesh} if patched else {}
    trainer = cls(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(sft_documents(a.docs)),
        processing_class=tiny_tokenizer(),
        **kw,
    )
    trainer.train()
    return trainer


def run_dpo(a, out_dir, kind="dpo"):
    """TRL's DPOTrainer (``--dpo-loss``), plain SGD (parameters compared: Adam would amplify float
    noise), beta 0.5 and a large step so that the policy moves away from the reference (rewards of
    order 1, not float noise). The reference model is passed unpatched: sp_trainer patches it."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from ringkv.trainer import sp_trainer
    from tests.models import tiny_model

    patched = a.sp is not None
    model, mesh = build_model(a.arch, patched, a.sp or 1, a.layout)
    ref = tiny_model(a.arch, 0)
    batch = a.batch if patched else a.batch * a.dp
    common = common_args(a, out_dir, batch)
    # non-padding tokens: the replicas pad their own batches, the reference pads their union
    common.update(learning_rate=a.dpo_lr, optim="sgd", include_num_input_tokens_seen="non_padding")
    args = DPOConfig(
        max_steps=a.steps,
        beta=0.5,
        loss_type=(a.dpo_loss if kind == "dpo" else a.dpo_more).split("+"),
        max_length=None,
        dataset_num_proc=None,
        **common,
    )
    cls = sp_trainer(DPOTrainer) if patched else DPOTrainer
    kw = {"sp_mesh": mesh} if patched else {}
    trainer = cls(
        model=model,
        ref_model=ref,
        args=args,
        train_dataset=Dataset.from_list(preference_rows(a.pairs)),
        processing_class=tiny_tokenizer(words=True),
        **kw,
    )
    trainer.train()
    if not patched or int(os.environ.get("RANK", 0)) == 0:
        params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        os.makedirs(out_dir, exist_ok=True)
        torch.save(params, os.path.join(out_dir, "params-ring.pt" if patched else "params-ref.pt"))
    return trainer


def grpo_prompts(n: int, seed: int = 4):
    """``n`` text prompts of 2..9 words of ``tiny_tokenizer(words=True)``: unequal lengths, so that
    generation and scoring see left-padded rows."""
    rng = random.Random(seed)
    return [
        {"prompt": " ".join(f"t{rng.randrange(3, 128)}" for _ in range(rng.randrange(2, 10)))}
        for _ in range(n)
    ]


def grpo_reward(completion_ids, **kwargs):
    """A deterministic reward of the completion's tokens."""
    return [sum(t % 3 == 0 for t in ids) + 0.25 * len(set(ids)) for ids in completion_ids]


def forced_rollout(prompts, trainer):
    """TRL's ``rollout_func``: completion ``j`` of a prompt's group (rows ``i``, ``j = i % G``;
    batches hold whole groups) starts with a token fixed by ``j``, then the policy's greedy
    ``generate`` (patched: the sharded KV cache) continues it. Deterministic and different within
    a group, whatever the batch's split over replicas (what sampling cannot be: its random stream
    is per process)."""
    tok, g = trainer.processing_class, trainer.num_generations
    prompt_ids = tok(text=prompts)["input_ids"]
    rows = [ids + [5 + 7 * (i % g)] for i, ids in enumerate(prompt_ids)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=trainer.max_completion_length - 1,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )[:, width:].tolist()
    completions = []
    for r, new in zip(rows, out):  # some end early with EOS (right-padded completions)
        cut = 1 + sum(r) % 5
        new = new[:cut] + [2] if cut < len(new) - 1 else new
        completions.append([r[-1], *new])
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def run_grpo(a, out_dir, kind="grpo"):
    """TRL's GRPOTrainer over ``--steps`` steps, plain SGD, beta 0.2 (the reference is built by TRL
    from the policy's saved copy and patched by sp_trainer). ``kind`` ``grpo_dr``: loss dr_grpo.
    ``--grpo-sample``: TRL's own generate with sampling (one replica only: the reference process
    draws the replicas' rows from one random stream); else ``forced_rollout`` with one generation
    per micro-batch (steps_per_generation=1: each micro-batch is the union of the replicas')."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ringkv.trainer import sp_trainer
    from tests.models import tiny_model

    patched = a.sp is not None
    init = os.path.join(out_dir, "init-ring" if patched else "init-ref")
    # TRL loads the reference from the policy's path (config._name_or_path)
    if not patched or int(os.environ["RANK"]) == 0:
        tiny_model(a.arch, 0).save_pretrained(init)
    if patched:
        import torch.distributed as dist

        dist.barrier()
    model, mesh = build_model(a.arch, patched, a.sp or 1, a.layout)
    model.config._name_or_path = init
    batch = a.batch if patched else a.batch * a.dp
    common = common_args(a, out_dir, batch)
    common.update(learning_rate=a.grpo_lr, optim="sgd", include_num_input_tokens_seen="no")
    sample = a.grpo_sample
    args = GRPOConfig(
        max_steps=2,
        beta=0.2,
        loss_type={"grpo_dr": "dr_grpo", "grpo_dapo": "dapo"}.get(kind, a.grpo_loss),
        num_generations=2,
        max_completion_length=6,
        temperature=a.grpo_temperature,
        gradient_checkpointing=False,
        generation_kwargs={"do_sample": True} if sample else None,
        steps_per_generation=None if sample else 1,
        **common,
    )
    cls = sp_trainer(GRPOTrainer) if patched else GRPOTrainer
    kw = {"sp_mesh": mesh} if patched else {}
    trainer = cls(
        model=model,
        reward_funcs=grpo_reward,
        args=args,
        train_dataset=Dataset.from_list(grpo_prompts(a.pairs)),
        processing_class=tiny_tokenizer(words=True),
        rollout_func=None if sample else forced_rollout,
        **kw,
    )
    trainer.train()
    if not patched or int(os.environ.get("RANK", 0)) == 0:
        params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        torch.save(params, os.path.join(out_dir, "params-ring.pt" if patched else "params-ref.pt"))
    return trainer


# what each logged step reports (SFTTrainer's metrics besides Trainer's loss and grad norm)
DPO_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)
GRPO_KEYS = (
    "kl",
    "reward",
    "reward_std",
    "rewards/grpo_reward/mean",
    "rewards/grpo_reward/std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
)
STEP_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
    *DPO_KEYS,
    *GRPO_KEYS,
)


def summary(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return {
        "steps": [{k: h[k] for k in STEP_KEYS if k in h} for h in logs],
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "max_steps": trainer.state.max_steps,
        "batches_per_epoch": len(trainer.get_train_dataloader()),
        "total_batch": trainer.get_total_train_batch_size(trainer.args),
        "wrapped": type(trainer.model_wrapped).__name__,
        "fsdp": trainer.is_fsdp_enabled,
        "ref_patched": _ref_patched(trainer),
    }


def _ref_patched(trainer):
    """DPO: the reference model's patch (its SP group's size), None when unpatched or not DPO."""
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        return None
    from ringkv.hf.patch import patch_state

    state = patch_state(trainer.accelerator.unwrap_model(ref))
    return None if state is None else state.world


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, default=1)
    p.add_argument(
        "--sp", type=int, default=None, help="set: the patched distributed run (under torchrun)"
    )
    p.add_argument("--kinds", default="trainer,sft")
    p.add_argument("--arch", default="llama")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--length", type=int, default=22)
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--docs", type=int, default=60)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--pairs", type=int, default=24)
    p.add_argument("--dpo-loss", default="sigmoid", help="DPOConfig.loss_type, '+'-joined")
    p.add_argument("--dpo-lr", type=float, default=2.0)
    p.add_argument(
        "--dpo-more",
        default="hinge+sigmoid_norm+apo_zero+apo_down+discopop+nca_pair+sppo_hard",
        help="kind dpo_more: the other loss types, summed in one run",
    )
    p.add_argument("--grpo-loss", default="grpo", help="GRPOConfig.loss_type of kind grpo")
    p.add_argument("--grpo-lr", type=float, default=0.5)
    p.add_argument("--grpo-sample", action="store_true", help="TRL's sampling generate (dp=1)")
    p.add_argument("--grpo-temperature", type=float, default=1.0, help="GRPOConfig.temperature")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if a.sp is not None:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = {}
    for kind in a.kinds.split(","):
        out_dir = os.path.join(os.path.dirname(a.out), kind)
        if kind.startswith("dpo"):
            trainer = run_dpo(a, out_dir, kind)
        elif kind.startswith("grpo"):
            trainer = run_grpo(a, out_dir, kind)
        else:
            trainer = {"trainer": run_trainer, "sft": run_sft}[kind](a, out_dir)
        results[kind] = summary(trainer)
        del trainer
    if a.sp is None or int(os.environ.get("RANK", 0)) == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    if a.sp is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()


# ---- world cases (tests/dist.py): sp_layout's checks on the session's 4-rank world ----


def layout_errors(ctx):
    """sp_layout over a (2, 2) mesh: patched over the mesh's sp dim (ok), over its dp dim with the
    mesh given (ValueError) and without it (ok: {0, 2} and {1, 3} tile the world), and over
    unequal groups {0, 1, 2}, {3} (ValueError). Every rank returns what it saw."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ringkv.hf
    from ringkv.trainer import sp_layout
    from tests.models import tiny_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    out = {}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except ValueError as e:
            out[name] = "ValueError: " + str(e)

    attempt(
        "sp",
        lambda: sp_layout(
            ringkv.hf.patch_model(tiny_model("llama", 0), group=mesh, mesh_dim="sp"), mesh
        ),
    )
    attempt(
        "dp_with_mesh",
        lambda: sp_layout(
            ringkv.hf.patch_model(tiny_model("llama", 0), group=mesh, mesh_dim="dp"), mesh
        ),
    )
    attempt(
        "dp_alone",
        lambda: sp_layout(ringkv.hf.patch_model(tiny_model("llama", 0), group=mesh, mesh_dim="dp")),
    )
    three, one = dist.new_group([0, 1, 2]), dist.new_group([3])
    attempt(
        "unequal",
        lambda: sp_layout(
            ringkv.hf.patch_model(tiny_model("llama", 0), group=three if ctx.rank < 3 else one)
        ),
    )
    return out
