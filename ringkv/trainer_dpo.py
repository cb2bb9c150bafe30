"""TRL's ``DPOTrainer`` under ``sp_trainer``: the policy's and the reference model's per-token
log-probs from the patched models' ``per_token=`` forward, never from logits, never from a shard.

TRL 1.16's ``DPOTrainer`` adds a fused LM head to both models (``trl.trainer.utils.
add_fused_lm_head``) and calls them as ``model(..., labels=labels, fused_lm_head=True)`` in
``_compute_loss`` and ``compute_ref_log_probs``. That head runs the base model and projects its last
hidden states itself: on a patched model those are this rank's shard ``(B, S_pad/N, H)``, so it
would score a shard against the unsharded labels. ``install_dpo`` replaces that call on both models
by two forward hooks:

* a pre-hook (run before ringkv's own) turns ``fused_lm_head=True`` into ``per_token=`` (the fields
  TRL reads: ``log_probs``, ``entropy``, ``is_top1``, ``mean_logits`` for the policy; ``log_probs``
  for the reference), so the patched forward computes them from its shard through the chunked
  kernel (``ringkv.kernels.linear_ce.linear_log_probs``) without logits;
* a forward hook all-gathers each field into global order and returns TRL's ``FusedCausalLMOutput``
  with ``(B, S - 1)`` fields, exactly the shape and order TRL's head gives (position ``i`` scores
  token ``i + 1``). The gather is differentiable: its backward hands each rank the gradient of its
  own positions (no communication), as ``sequence_sums`` does, so the gradients summed over the SP
  group (the mixin's ``x sp`` under DDP's mean) are the whole sequences'.

Every rank of an SP group then runs TRL's own ``_compute_loss`` on identical whole-sequence values:
the sequence sums, ``ld_alpha``'s length masks, the loss types and every logged metric are TRL's
code on TRL's inputs. The gathered tensors are ``(B, S)`` floats per field, not ``(B, S, V)``.

The reference model is patched here with the policy's group, layout and method when it is not
patched yet (TRL builds it from the policy's path when ``ref_model`` is None); a reference patched
over another group or layout is a ``ValueError``. ``check_dpo`` refuses, before TRL builds anything,
the options this path cannot honour.
"""

from __future__ import annotations

import sys

import torch

# loss types whose exactness under sp_trainer the tests check (tests/test_trainer.py: sigmoid and
# ipo alone, the others summed in one run); the rest are refused: "sft" (a token mean per replica),
# "aot" and "aot_unpaired" (sorted within a batch), "bco_pair" (running statistics), "robust" and
# "exo_pair" (not checked)
DPO_LOSS_TYPES = (
    "sigmoid",
    "ipo",
    "hinge",
    "sigmoid_norm",
    "apo_zero",
    "apo_down",
    "discopop",
    "nca_pair",
    "sppo_hard",
)

POLICY_FIELDS = ("log_probs", "entropy", "is_top1", "mean_logits")
REF_FIELDS = ("log_probs",)


def trl_class(name: str):
    """TRL's class ``name`` if TRL is imported already (never imported here), else None."""
    return getattr(sys.modules.get("trl"), name, None)


def is_dpo(trainer) -> bool:
    dpo = trl_class("DPOTrainer")
    return dpo is not None and isinstance(trainer, dpo)


def check_dpo(args, kwargs) -> None:
    """``ValueError`` naming the ``DPOConfig`` option (or trainer argument) that the patched path
    cannot honour; called before ``DPOTrainer.__init__`` runs."""

    def refuse(option, why):
        raise ValueError(f"ringkv.trainer: sp_trainer(DPOTrainer) does not support {option}: {why}")

    if args is None:
        return  # DPOTrainer's default DPOConfig: sigmoid, no precompute
    bad = [t for t in args.loss_type if t not in DPO_LOSS_TYPES]
    if bad:
        refuse(
            f"loss_type={bad}",
            f"the supported loss types are {list(DPO_LOSS_TYPES)} (those checked against TRL's "
            "own run)",
        )
    if args.use_weighting:
        refuse(
            "use_weighting=True", "WPO's weights need log_sum_sq_probs, which ringkv's kernel lacks"
        )
    if args.precompute_ref_log_probs:
        refuse(
            "precompute_ref_log_probs=True",
            "TRL's precompute pass shards the dataset over all processes, not over the dp "
            "replicas; pass a ref_model (patched or not) instead",
        )
    if args.use_liger_kernel:
        refuse("use_liger_kernel=True", "Liger's kernels would replace the patched model's layers")
    if kwargs.get("peft_config") is not None:
        refuse("peft_config", "the reference would be the adapter-disabled policy; untested")
    if kwargs.get("compute_metrics") is not None:
        refuse(
            "compute_metrics",
            "TRL's return_outputs path recomputes logits without labels, which a patched model "
            "returns for its shard only",
        )
    from transformers.utils import is_peft_available

    model = kwargs.get("model")
    if is_peft_available() and model is not None and not isinstance(model, str):
        from peft import PeftModel

        if isinstance(model, PeftModel):
            refuse("a PeftModel", "the reference would be the adapter-disabled policy; untested")


class _Unshard(torch.autograd.Function):
    """All-gather ``(B, S_pad/N)`` shards into global order ``(B, S_pad)``; the backward is this
    rank's positions of the gradient (every rank computes the same loss from the whole values)."""

    @staticmethod
    def forward(ctx, x, layout, group):
        from .sp.layout import unshard

        ctx.layout, ctx.group = layout, group
        return unshard(x.contiguous(), 1, layout, group)

    @staticmethod
    def backward(ctx, g):
        from .sp.layout import shard

        return shard(g, 1, ctx.layout, ctx.group).contiguous(), None, None


def patch_reference(ref, state):
    """The reference model, patched like the policy (``state``) if it is not yet."""
    import torch.distributed as dist

    from .hf import patch_model
    from .hf.patch import patch_state

    rs = patch_state(ref)
    if rs is None:
        timeout = None if state.timeout is None else state.timeout.total_seconds()
        return patch_model(
            ref,
            group=state.group,
            layout=state.layout,
            method=state.method,
            inputs="full",
            timeout=timeout,
            keep_logits=state.keep_logits,
            loss_chunk=state.loss_chunk,
        )

    def ranks(g):
        if g is None or not dist.is_initialized():
            return None
        return sorted(dist.get_process_group_ranks(g))

    if ranks(rs.group) != ranks(state.group) or rs.layout != state.layout or rs.inputs != "full":
        raise ValueError(
            "ringkv.trainer: the reference model is patched over another group or layout than the "
            f"policy (layout {rs.layout!r} vs {state.layout!r}, inputs {rs.inputs!r}); patch both "
            "with the same patch_model(..., group=..., layout=...) or pass the reference unpatched"
        )
    return ref


def _left_pads(mask):
    """``(B,)`` the leading zeros of each row of ``mask`` ``(B, S)``, or None without any."""
    if mask is None or bool(mask[:, 0].all()):
        return None
    return (mask.cumsum(1) == 0).sum(1)


def _roll(x, shift, back=False):
    """Each row of ``x`` ``(B, S)`` rotated left by its ``shift`` (``back``: right): left padding
    moved to the end of the row, and back."""
    cols = torch.arange(x.shape[1], device=x.device)
    index = (cols + (-shift if back else shift)[:, None].to(x.device)) % x.shape[1]  # (B, S)
    return x.gather(1, index)


def fused_head_hooks(model, state, fields, temperature: float = 1.0):
    """The two forward hooks that answer TRL's ``fused_lm_head=True`` call on ``model``. Rows with
    left padding (GRPO's prompts) are rolled so that it ends them, as the patched forward takes it,
    and the fields rolled back: rotary attention sees the same position differences, pads no key.
    ``temperature``: TRL's head divides the logits by it (GRPO)."""
    from trl.trainer.utils import FusedCausalLMOutput

    pending = []  # (sequence length, left pads) of the fused call under way (one at a time)

    def pre(module, args, kwargs):
        if not kwargs.pop("fused_lm_head", False):
            return None
        if kwargs.get("labels") is None or kwargs.get("shift_labels") is not None:
            raise ValueError(
                "ringkv.trainer: a fused_lm_head call needs labels (and no shift_labels) under "
                "sp_trainer(DPOTrainer) or sp_trainer(GRPOTrainer)"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        pads = _left_pads(kwargs.get("attention_mask"))
        if pads is not None:
            if args or kwargs.get("position_ids") is not None:
                raise ValueError(
                    "ringkv.trainer: a left-padded fused_lm_head call must pass input_ids by "
                    "keyword and no position_ids"
                )
            for name in ("input_ids", "attention_mask", "labels"):
                kwargs[name] = _roll(kwargs[name], pads)
        pending.append((ids.shape[1], pads))
        kwargs["per_token"] = fields
        if temperature != 1.0:
            kwargs["per_token_temperature"] = temperature
        kwargs["use_cache"] = False
        return args, kwargs

    def post(module, args, output):
        if not pending:
            return None
        seq, pads = pending.pop()
        out = {}
        for name in (*fields, "label_mask"):
            x = output[name]
            kind = x.dtype
            if kind == torch.bool:
                x = x.to(torch.uint8)
            full = _Unshard.apply(x, state.layout, state.group)[:, :seq]  # (B, S)
            if pads is not None:  # the fields of pads are 0: rolled back, the end pads lead again
                full = _roll(full, pads, back=True)
            full = full[:, : seq - 1]  # position i scores token i + 1, as TRL's head
            out[name] = full.bool() if kind == torch.bool else full
        return FusedCausalLMOutput(loss=output.loss, **out)

    model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    model.register_forward_hook(post)


def install_dpo(trainer) -> None:
    """After ``DPOTrainer.__init__``: patch the reference like the policy and hook both models'
    ``fused_lm_head`` calls (module docstring)."""
    from .hf.patch import patch_state

    policy = trainer.accelerator.unwrap_model(trainer.model)
    state = patch_state(policy)
    if state.ulysses != 1:
        raise ValueError(
            "ringkv.trainer: sp_trainer(DPOTrainer) gathers per-token values over a 1-D SP group; "
            "patch with method='ring' or 'ulysses', not 'usp'"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            "ringkv.trainer: DPOTrainer's MoE load-balancing loss would come from the router "
            "logits of one rank's shard; set router_aux_loss_coef=0 to train without it"
        )
    if trainer.ref_model is None:
        raise ValueError(
            "ringkv.trainer: sp_trainer(DPOTrainer) needs a reference model (TRL left it None: "
            "PEFT or precompute_ref_log_probs); pass ref_model="
        )
    ref = trainer.accelerator.unwrap_model(trainer.ref_model)
    ref_state = patch_state(patch_reference(ref, state))
    if ref_state is None:  # never silently TRL's head on a full sequence beside a patched policy
        raise ValueError("ringkv.trainer: the reference model could not be patched")
    fused_head_hooks(policy, state, POLICY_FIELDS)
    fused_head_hooks(ref, ref_state, REF_FIELDS)
