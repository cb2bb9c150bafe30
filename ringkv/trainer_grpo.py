"""TRL's ``GRPOTrainer`` under ``sp_trainer``: rollouts through the patched model's ``generate``
(sharded KV cache), per-token log-probs of the policy and the reference from the patched models'
``per_token=`` forward (never logits, never a shard), rewards and advantages over the dp replicas.

TRL 1.16's ``GRPOTrainer`` scores completions as DPO does, through a fused LM head
(``model(..., labels=labels, fused_lm_head=True)`` in ``_get_per_token_logps_and_entropies``, for
the policy, the old policy and the reference). ``install_grpo`` answers those calls with the hooks
of ``trainer_dpo`` (``log_probs`` and ``entropy`` for the policy, ``log_probs`` for the reference):
each rank computes its shard through the chunked kernel and the values are all-gathered,
differentiably, into TRL's whole-sequence ``(B, S - 1)`` fields. GRPO's rows are left-padded
prompts followed by right-padded completions; the hooks roll each row's left padding to its end
before the patched forward (which takes padding at the end of rows only) and roll the fields back
(rotary attention depends on position differences only, so the values are TRL's). Every rank of an
SP group then runs TRL's own ``_compute_loss`` (clipped ratio, KL to the reference, the loss types'
normalisations, every logged metric) on identical values.

The ranks of an SP group are one data-parallel replica (``ringkv/trainer.py``). GRPO's accounting
follows: ``generation_batch_size`` is ``per_device_train_batch_size * steps_per_generation * dp``
(TRL's config counted every process), the torch seed is ``seed + dp_rank`` (TRL's is ``seed +
process index``: the ranks of a group must shuffle, and sample, alike), and while TRL generates
and scores a batch it sees the replicas as its processes (``_Replicas``: ``process_index`` is the
replica, ``num_processes`` is ``dp``, ``gather`` keeps one copy per replica), so the rewards are
grouped and normalised over the replicas' completions and each replica takes its own advantages.

Generation: TRL's own ``generate`` call on the unwrapped patched model. The prompts are
left-padded, which the patch's batched ``generate`` takes (``method="ring"``); every rank of a group
gets the same tokens (sampling: the same seed, above) and keeps ``1/sp`` of the KV cache. TRL's
vLLM paths (``use_vllm``) need a vLLM server, or a colocated vLLM holding the whole model and KV
cache in every process, outside the SP group: refused. A ``rollout_func`` runs on every rank of a
group and must return the same completions on each (e.g. from the patched ``generate``).
TRL's ``temperature`` divides the logits of its head; the hooks pass it on as the patched forward's
``per_token_temperature``. TRL accepts ``temperature=0`` in its config but then fails in generate
(transformers' temperature warper) and would score with logits divided by 0; it is refused here:
greedy generation is ``generation_kwargs={"do_sample": False}`` at temperature 1.
"""

from __future__ import annotations

import contextlib

from .trainer_dpo import trl_class

# checked against TRL's own run (tests/test_trainer.py); "dapo" is GRPOConfig's default
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")

POLICY_FIELDS = ("log_probs", "entropy")
REF_FIELDS = ("log_probs",)


def is_grpo_class(cls) -> bool:
    grpo = trl_class("GRPOTrainer")
    return grpo is not None and isinstance(cls, type) and issubclass(cls, grpo)


def _refuse(option, why):
    raise ValueError(f"ringkv.trainer: sp_trainer(GRPOTrainer) does not support {option}: {why}")


def check_grpo(args, kwargs) -> None:
    """``ValueError`` naming the ``GRPOConfig`` option (or trainer argument) that the patched path
    cannot honour; called before ``GRPOTrainer.__init__`` runs. Then sets ``generation_batch_size``
    from the dp replicas (``args`` is changed in place)."""
    if args is None:
        _refuse(
            "args=None", "pass a GRPOConfig (TRL's default one counts every process as a replica)"
        )
    if args.loss_type not in GRPO_LOSS_TYPES:
        _refuse(
            f"loss_type={args.loss_type!r}",
            f"the supported loss types are {list(GRPO_LOSS_TYPES)} (those checked against TRL's "
            "own run)",
        )
    options = (  # (set, option, why)
        (args.use_vllm, "use_vllm=True", "generation runs through the patched model's generate"),
        (
            args.use_transformers_continuous_batching,
            "use_transformers_continuous_batching=True",
            "transformers' paged generate_batch bypasses the sharded KV cache",
        ),
        (
            args.use_liger_kernel,
            "use_liger_kernel=True",
            "Liger's kernels would replace the layers",
        ),
        (
            args.cast_lm_head_to_fp32,
            "cast_lm_head_to_fp32=True",
            "the chunked kernel reads the head's weight as it is",
        ),
        (
            not args.temperature > 0,
            f"temperature={args.temperature}",
            "TRL divides the logits by it; for greedy generation pass "
            "generation_kwargs={'do_sample': False} at temperature 1.0",
        ),
        (
            args.top_entropy_quantile < 1.0,
            f"top_entropy_quantile={args.top_entropy_quantile}",
            "TRL's entropy quantile gathers over every process, each replica sp times (untested)",
        ),
        (
            args.log_completions,
            "log_completions=True",
            "TRL gathers the completions' text over every process, each replica sp times",
        ),
    )
    for bad, option, why in options:
        if bad:
            _refuse(option, why)
    for name, why in (
        ("peft_config", "the reference would be the adapter-disabled policy; untested"),
        ("tools", "tool calls insert tokens between generate calls; untested"),
        ("environment_factory", "environments insert tokens between generate calls; untested"),
    ):
        if kwargs.get(name):
            _refuse(name, why)
    _check_model(kwargs)
    _replica_batches(args, kwargs.get("model"))


def _check_model(kwargs) -> None:
    from transformers import ProcessorMixin
    from transformers.utils import is_peft_available

    model = kwargs.get("model")
    if isinstance(kwargs.get("processing_class"), ProcessorMixin):
        _refuse("a multimodal processing_class", "images are not sharded by the patch; untested")
    if model is None or isinstance(model, str):
        _refuse("a model name", "TRL would build the policy unpatched; pass the patched model")
    if is_peft_available():
        from peft import PeftModel

        if isinstance(model, PeftModel):
            _refuse("a PeftModel", "the reference would be the adapter-disabled policy; untested")


def _replica_batches(args, model) -> None:
    """``args.generation_batch_size`` over the ``dp`` replicas, not over every process."""
    import torch.distributed as dist

    from .hf.patch import patch_state

    state = patch_state(model)
    if state is None or not dist.is_initialized():
        return  # sp_layout refuses an unpatched model after TRL's __init__
    sp = dist.get_world_size(state.group) if state.group is not None else dist.get_world_size()
    dp = dist.get_world_size() // sp
    args.generation_batch_size = args.per_device_train_batch_size * args.steps_per_generation * dp
    if args.generation_batch_size % args.num_generations:
        raise ValueError(
            f"ringkv.trainer: generation_batch_size ({args.generation_batch_size} = "
            f"per_device_train_batch_size x steps_per_generation x {dp} replicas) must be "
            f"divisible by num_generations ({args.num_generations})"
        )


class _Replicas:
    """``trainer.accelerator`` as TRL's generation code should see it under ``(dp, sp)``: the dp
    replicas are the processes. ``gather`` all-gathers over the world and keeps the first rank of
    each replica (``leads``), in replica order; everything else is the accelerator's."""

    def __init__(self, accelerator, dp, dp_rank, leads, world):
        self._acc, self._leads, self._world = accelerator, leads, world
        self.num_processes, self.process_index = dp, dp_rank

    def gather(self, tensor):
        every = self._acc.gather(tensor)  # (world * n, ...)
        every = every.unflatten(0, (self._world, every.shape[0] // self._world))
        return every[self._leads].flatten(0, 1)  # (dp * n, ...)

    def __getattr__(self, name):
        return getattr(self._acc, name)


class GRPOMixin:
    """``sp_trainer``'s bases for a ``GRPOTrainer`` subclass put this before ``SPTrainerMixin``."""

    def __init__(self, *args, **kwargs):
        names = ("model", "reward_funcs", "args")
        both = {**dict(zip(names, args)), **kwargs}
        check_grpo(both.get("args"), both)
        super().__init__(*args, **kwargs)
        install_grpo(self)

    @contextlib.contextmanager
    def _as_replicas(self):
        accelerator, self.accelerator = self.accelerator, self._ringkv_replicas
        try:
            yield
        finally:
            self.accelerator = accelerator

    def _generate_and_score_completions(self, inputs):
        with self._as_replicas():  # rewards, advantages, lengths and token counts per replica
            return super()._generate_and_score_completions(inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._as_replicas():  # dapo's normaliser (num_processes) and the metrics' gathers
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL gathers the rewards with accelerate's gather over every process; keep one per replica
        every = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        replicas = self._ringkv_replicas
        every = every.unflatten(0, (replicas._world, len(prompts)))  # (world, B, funcs)
        return every[replicas._leads].flatten(0, 1)  # (dp * B, funcs)


def install_grpo(trainer) -> None:
    """After ``GRPOTrainer.__init__``: refuse what TRL built that the path cannot honour, patch the
    reference like the policy, hook both models' ``fused_lm_head`` calls, reseed per replica and
    build the replicas' view of the accelerator (module docstring)."""
    import torch.distributed as dist
    from transformers import set_seed

    from .hf.patch import patch_state
    from .trainer_dpo import fused_head_hooks, patch_reference

    policy = trainer.accelerator.unwrap_model(trainer.model)
    state = patch_state(policy)
    if state.ulysses != 1:
        _refuse("method='usp'", "per-token values are gathered over a 1-D SP group")
    if trainer.aux_loss_enabled:
        _refuse(
            "the MoE load-balancing loss",
            "it would come from one rank's shard of router logits; set router_aux_loss_coef=0",
        )
    if trainer.ref_model is not None:
        ref = trainer.accelerator.unwrap_model(trainer.ref_model)
        ref_state = patch_state(patch_reference(ref, state))
        if ref_state is None:  # never TRL's head on a full sequence beside a patched policy
            raise ValueError("ringkv.trainer: the reference model could not be patched")
        fused_head_hooks(ref, ref_state, REF_FIELDS, trainer.temperature)
    fused_head_hooks(policy, state, POLICY_FIELDS, trainer.temperature)
    world, leads = 1, [0]
    if dist.is_initialized():
        world = dist.get_world_size()
        groups = [None] * world
        mine = (
            dist.get_process_group_ranks(state.group) if state.group is not None else range(world)
        )
        dist.all_gather_object(groups, min(mine))
        leads = sorted(set(groups))
    trainer._ringkv_replicas = _Replicas(
        trainer.accelerator, trainer.dp_size, trainer.dp_rank, leads, world
    )
    set_seed(trainer.args.seed + trainer.dp_rank)  # TRL's was seed + process index
