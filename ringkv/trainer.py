"""transformers' ``Trainer`` (and TRL's ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer``) on a
``(dp, sp)`` layout of a ringkv-patched model.

    from ringkv.hf import patch_model
    from ringkv.trainer import sp_trainer

    # every rank: the SP group of its replica
    model = patch_model(model, group=mesh, mesh_dim="sp")
    trainer = sp_trainer(Trainer)(model=model, args=args, train_dataset=ds, data_collator=collate)
    trainer.train()                                              # under torchrun, dp * sp processes

``sp_trainer(cls)`` returns a subclass of ``cls`` (any ``transformers.Trainer`` subclass) with
``SPTrainerMixin`` first in its bases. The mixin reads the SP group from the patched model and
changes four things, each by overriding a public ``Trainer`` method and calling the original:

* ``get_train_dataloader`` / ``get_eval_dataloader``: accelerate shards batches over every
  process (its ``BatchSamplerShard`` has ``num_processes = world``). The mixin sets it to ``dp``
  replicas and the replica's index, so the ranks of one SP group get the same batches and the
  replicas split the data exactly as ``dp`` plain workers would.
* ``get_total_train_batch_size``: ``per_device * gradient_accumulation_steps * dp``, not the
  world (``max_steps`` from epochs, ``num_train_samples``; the epoch length is the resharded
  dataloader's, so ``state.epoch`` counts dp replicas' batches); ``num_input_tokens_seen``
  counts each replica's tokens once (Trainer's private ``_track_num_input_tokens``, corrected
  after it runs: a Trainer without it counts nothing to correct).
* ``training_step`` / ``compute_loss``: accelerate's DDP (or FSDP2) reduces gradients over all
  ``dp * sp`` processes with a MEAN; ringkv's SP ranks hold *shares* of one replica's gradient,
  which must be SUMMED. So the loss that ``backward`` sees is ``sp`` times the loss ``Trainer``
  computed (docs/hf.md's "DDP over dp x sp" recipe), and ``training_step`` returns it divided by
  ``sp`` again, so the logged loss is ``Trainer``'s own. ``Trainer``'s token count
  (``num_items_in_batch``, gathered over the world, so ``sp`` times the dp replicas' count) and its
  ``* num_processes`` factor are left as they are: together with the ``sp`` above they give every
  step the gradient of (sum of the token losses of all replicas' micro-batches) / (their label
  count), as one unpatched process gets from the same batches. The arithmetic is in docs/hf.md.

TRL's ``SFTTrainer`` computes its training loss with a fused LM head that runs the backbone and
the head itself (``model(..., fused_lm_head=True)``), outside the patched model's sequence-parallel
loss. Under ``sp_trainer`` the SFT loss is ``Trainer.compute_loss``'s, i.e. the patched model's
own (the same negative log-likelihood over the same tokens, ``num_items_in_batch`` honoured),
from a forward with ``per_token=("entropy", "is_top1")``: the chunked kernel gives each rank its
shard's per-token log-probs, entropies and top-1 hits in the same pass through the head, and the
mixin logs TRL's ``entropy`` and ``mean_token_accuracy`` from them as TRL does (sums gathered over
the world: every token of every SP shard and replica once) and ``num_tokens`` counting each
replica's batch once. ``loss_type`` other than ``"nll"``, a ``compute_loss_func``, label smoothing
and the MoE load-balancing loss (``router_aux_loss_coef``) are refused with a ``ValueError``.

TRL's ``DPOTrainer`` calls the policy and the reference with the same fused head;
``ringkv/trainer_dpo.py`` patches the reference like the policy (when it is not) and answers both
models' ``fused_lm_head=True`` calls with the patched ``per_token=`` forward, gathered into TRL's
whole-sequence ``(B, S - 1)`` fields, so TRL's own ``_compute_loss`` (sequence sums, loss types,
rewards, margins, accuracies) runs on every rank on exact values. The options that path cannot
honour are refused at construction (``trainer_dpo.check_dpo``); ``num_tokens`` counts each
replica once.

``sp_trainer(GRPOTrainer)`` puts ``trainer_grpo.GRPOMixin`` in front as well: the same hooks answer
GRPO's fused-head calls (left-padded prompts rolled to the row's end), the generation batch, the
seed, the rewards, the advantages and TRL's gathers are per dp replica, and the completions come
from the patched model's ``generate`` (``ringkv/trainer_grpo.py``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

__all__ = ["SPTrainerMixin", "sp_trainer", "sp_layout"]


def sp_layout(model, mesh=None, mesh_dim: str = "sp"):
    """``(sp, dp, dp_rank)`` of this process for a model patched by ``ringkv.patch_model``.

    The SP groups (one per replica) must partition the world into groups of equal size; replicas
    are numbered by their lowest rank. With ``mesh`` (a ``DeviceMesh``), its ``mesh_dim``
    dimension must be the patched group. One ``all_gather_object`` over the world; every rank
    must call it. Raises ``ValueError`` (the same on every rank) for a model that is not patched,
    a patch over other ranks than the mesh's, or groups that do not tile the world."""
    from .hf.patch import patch_state  # ringkv.hf needs transformers, as the Trainer does

    state = patch_state(model)
    if state is None:
        raise ValueError(
            "ringkv.trainer: the model is not patched; call ringkv.hf.patch_model(model, "
            "group=...) on every rank before building the Trainer"
        )
    if state.inputs != "full":
        raise ValueError(
            f"ringkv.trainer: the model was patched with inputs={state.inputs!r}; Trainer passes "
            "each replica's whole batch to every rank of its SP group: patch with inputs='full'"
        )
    if not dist.is_initialized():
        return 1, 1, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    group_ranks = (
        tuple(sorted(dist.get_process_group_ranks(state.group)))
        if state.group is not None
        else tuple(range(world))
    )
    mesh_ranks = None
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if mesh_dim not in names:
            raise ValueError(
                f"ringkv.trainer: mesh has no dimension {mesh_dim!r} (its dims are {names})"
            )
        mesh_ranks = tuple(sorted(dist.get_process_group_ranks(mesh.get_group(mesh_dim))))
    everyone = [None] * world
    dist.all_gather_object(
        everyone, (group_ranks, mesh_ranks)
    )  # every rank checks every rank's view alike
    sp = len(group_ranks)
    for r, (g, m) in enumerate(everyone):
        if m is not None and m != g:
            raise ValueError(
                f"ringkv.trainer: rank {r}'s model is patched over ranks {list(g)}, but the mesh's "
                f"{mesh_dim!r} group of that rank is {list(m)}; patch with "
                f"patch_model(model, group=mesh, mesh_dim={mesh_dim!r})"
            )
        if len(g) != sp or r not in g or any(set(g) & set(h) and g != h for h, _ in everyone):
            raise ValueError(
                "ringkv.trainer: the ranks' SP groups must split the world into equal, disjoint "
                f"groups (a (dp, sp) layout); rank {r} is patched over ranks {list(g)}, rank "
                f"{rank} over {list(group_ranks)}"
            )
    if world % sp:
        raise ValueError(
            f"ringkv.trainer: the world of {world} ranks is not divisible by the SP group size {sp}"
        )
    replicas = sorted({g for g, _ in everyone})
    return sp, len(replicas), replicas.index(group_ranks)


class SPTrainerMixin:
    """Put first in the bases of a ``transformers.Trainer`` subclass (or use ``sp_trainer(cls)``).
    Extra keyword argument ``sp_mesh``: a ``DeviceMesh`` whose ``"sp"`` dimension the model must
    be patched over (checked; optional)."""

    def __init__(self, *args, sp_mesh=None, **kwargs):
        from .trainer_dpo import check_dpo, install_dpo, is_dpo

        trl = sys.modules.get("trl")
        dpo_cls = getattr(trl, "DPOTrainer", None) if trl is not None else None
        if dpo_cls is not None and issubclass(type(self), dpo_cls):
            # before TRL builds anything: the options the patched path cannot honour
            names = ("model", "ref_model", "args")
            check_dpo(
                kwargs.get("args", args[2] if len(args) > 2 else None),
                {**dict(zip(names, args)), **kwargs},
            )
        super().__init__(*args, **kwargs)
        self.sp_size, self.dp_size, self.dp_rank = sp_layout(self.model, sp_mesh)
        self._ringkv_backward = False
        if is_dpo(self):
            install_dpo(self)
        if self._is_sft():
            if (
                self.compute_loss_func is not None
                or getattr(self.args, "loss_type", "nll") != "nll"
                or self.label_smoother is not None
            ):
                raise ValueError(
                    "ringkv.trainer: with SFTTrainer only loss_type='nll' without "
                    "compute_loss_func or "
                    "label smoothing is supported (the loss is the patched model's own)"
                )
            if getattr(self, "aux_loss_enabled", False):
                raise ValueError(
                    "ringkv.trainer: SFTTrainer's MoE load-balancing loss would come from the "
                    "router logits of one rank's shard; set the model config's "
                    "router_aux_loss_coef=0 to train without it"
                )

    def _is_sft(self) -> bool:
        trl = sys.modules.get("trl")
        sft = getattr(trl, "SFTTrainer", None) if trl is not None else None
        return sft is not None and isinstance(self, sft)

    # ---- data: the same batches on the ranks of one SP group ----

    def _reshard(self, loader, what: str):
        if self.sp_size == 1:
            return loader
        world, rank = dist.get_world_size(), dist.get_rank()
        for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
            if (
                hasattr(shard, "num_processes")
                and hasattr(shard, "process_index")
                and hasattr(shard, "batch_sampler")
            ):
                if (shard.num_processes, shard.process_index) != (world, rank):
                    break
                shard.num_processes, shard.process_index = self.dp_size, self.dp_rank
                return loader
        raise ValueError(
            f"ringkv.trainer: the {what} dataloader is not sharded by accelerate's "
            f"BatchSamplerShard over the {world} processes ({type(loader).__name__}); use a "
            "map-style dataset (with __len__) and the default sampler, so that each SP group gets "
            "one replica's batches"
        )

    def get_train_dataloader(self):
        return self._reshard(super().get_train_dataloader(), "training")

    def get_eval_dataloader(self, eval_dataset=None):
        return self._reshard(super().get_eval_dataloader(eval_dataset), "evaluation")

    def get_test_dataloader(self, test_dataset):
        return self._reshard(super().get_test_dataloader(test_dataset), "test")

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.dp_size

    def _track_num_input_tokens(self, inputs):
        # Trainer sums every process's batch (include_num_input_tokens_seen): sp ranks share one
        # replica's batch
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = (
            before + (self.state.num_input_tokens_seen - before) // self.sp_size
        )

    # ---- loss: SUM over sp under a wrapper that takes the MEAN over dp * sp ----

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        self._ringkv_backward = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        finally:
            self._ringkv_backward = False
        return (
            loss / self.sp_size
        )  # what Trainer logs: its own loss, not the sp times larger one backward saw

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if (
            self._is_sft()
        ):  # TRL's fused LM head bypasses the patched model's loss: use the model's own
            from transformers import Trainer

            inputs = {**inputs, "use_cache": False, "per_token": ("entropy", "is_top1")}
            loss, outputs = Trainer.compute_loss(
                self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            self._sft_metrics(outputs, inputs)
            out = (loss, outputs) if return_outputs else loss
        elif self._is_dpo():  # TRL's own loss on whole-sequence values (ringkv/trainer_dpo.py)
            before = self._total_train_tokens
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            if self.model.training:  # TRL's gather over the world counts each replica sp times
                self._total_train_tokens = (
                    before + (self._total_train_tokens - before) // self.sp_size
                )
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        else:
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if not self._ringkv_backward or self.sp_size == 1:
            return out
        if return_outputs:
            return out[0] * self.sp_size, out[1]
        return out * self.sp_size

    def _is_dpo(self) -> bool:
        from .trainer_dpo import is_dpo

        return is_dpo(self)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self._is_dpo():  # TRL's logits path recomputes logits without labels: a shard's, unused
            prediction_loss_only = True  # compute_metrics (their only reader) is refused
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _sft_metrics(self, outputs, inputs) -> None:
        """What TRL's ``SFTTrainer.compute_loss`` logs, from this rank's per-token ``outputs``
        ``(B, S_local)``: the world's gather sums every shard of every replica once; ``num_tokens``
        divides by ``sp`` the replica's batch that each of its ``sp`` ranks holds."""
        mode = "train" if self.model.training else "eval"
        gather, metrics = self.accelerator.gather_for_metrics, self._metrics[mode]
        valid = gather(outputs.label_mask.sum()).sum()
        entropy = gather(outputs.entropy.detach().sum()).sum()
        correct = gather(outputs.is_top1.sum()).sum()
        metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                n = inputs["attention_mask"].sum()
            else:  # padding-free: one packed row
                n = torch.tensor(
                    inputs["position_ids"].size(1), device=inputs["position_ids"].device
                )
            tp = getattr(self, "_tp_size", 1)
            self._total_train_tokens += gather(n).sum().item() // (tp * self.sp_size)
        metrics["num_tokens"] = [self._total_train_tokens]


def sp_trainer(cls):
    """A subclass of the Trainer class ``cls`` with ``SPTrainerMixin`` first:
    ``sp_trainer(Trainer)(...)`` or ``sp_trainer(SFTTrainer)(...)`` take the same arguments as
    ``cls`` (plus ``sp_mesh=``)."""
    from transformers import Trainer

    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"sp_trainer needs a transformers.Trainer subclass, got {cls!r}")
    if issubclass(cls, SPTrainerMixin):
        return cls
    from .trainer_grpo import GRPOMixin, is_grpo_class

    mixins = (GRPOMixin, SPTrainerMixin) if is_grpo_class(cls) else (SPTrainerMixin,)
    return type(f"SP{cls.__name__}", (*mixins, cls), {"__module__": cls.__module__})
