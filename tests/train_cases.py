"""World cases for tests/test_hf_train.py: training steps of a patched model with the chunked loss,
the tiled MLP and offloaded checkpoints (each run on every rank of the case's group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ringkv
from ringkv import hf
from ringkv.memory import FileStore
from tests.hf_cases import build


def targets(labels: torch.Tensor) -> torch.Tensor:
    """HF's ``shift_labels`` of ``labels`` ``(B, S)``: the target of each token, -100 at each row's
    end."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def step_kwargs(ids, labels, form, position_ids=None, num_items=None):
    """The keyword arguments of one training forward: labels as ``form`` (labels / shift / both)."""
    kw = dict(input_ids=ids, use_cache=False)
    if form in ("labels", "both"):
        kw["labels"] = labels
    if form in ("shift", "both"):
        kw["shift_labels"] = targets(labels)
    if position_ids is not None:
        kw["position_ids"] = position_ids
    if num_items is not None:
        kw["num_items_in_batch"] = torch.tensor(num_items)
    return kw


def unpatched_step(
    arch,
    seed,
    ids,
    labels,
    form="labels",
    position_ids=None,
    num_items=None,
    config=None,
    dtype=torch.float32,
):
    """The unpatched model, one process: loss and gradients of the same step."""
    model = build(arch, seed, **(config or {})).to(dtype).train()
    # HF computes a loss only when labels come (shift_labels then replace their shift); ringkv takes
    # either alone
    out = model(
        **step_kwargs(ids, labels, "both" if form == "shift" else form, position_ids, num_items)
    )
    out.loss.backward()
    return out.loss.item(), {n: p.grad for n, p in model.named_parameters()}


def chunked_step(ctx, arch, seed, ids, labels, layout, inputs, opts):
    """A patched training step. ``opts``: ``form`` (labels / shift / both), ``position_ids`` (packed
    rows, inputs="full"), ``num_items``, ``patch`` (patch_model's keyword arguments),
    ``checkpointing`` (None, "reentrant" or "plain"), ``store`` (offload to a FileStore), ``config``
    (model overrides).
    Returns the loss, whether logits came back, this rank's gradients and what the store saw."""
    model = build(arch, seed, **opts.get("config", {})).train()
    store = FileStore() if opts.get("store") else False
    hf.patch_model(
        model,
        sp=ctx.world,
        group=ctx.group,
        layout=layout,
        inputs=inputs,
        offload_checkpoints=store,
        **opts.get("patch", {}),
    )
    if opts.get("checkpointing"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": opts["checkpointing"] == "reentrant"}
        )
    form = opts.get("form", "labels")
    if inputs == "shard":

        def mine(x):
            return ringkv.shard(x, 1, layout, ctx.group)

        kw = dict(input_ids=mine(ids), use_cache=False)
        if form in ("labels", "both"):
            kw["labels"] = mine(labels)
        if form in ("shift", "both"):
            kw["shift_labels"] = mine(targets(labels))
        if opts.get("num_items") is not None:
            kw["num_items_in_batch"] = opts["num_items"]
    else:
        kw = step_kwargs(ids, labels, form, opts.get("position_ids"), opts.get("num_items"))
    out = model(**kw)
    stored = list(store.stored) if store else []
    out.loss.backward()
    return dict(
        loss=out.loss.item(),
        logits=out.logits is not None,
        keys=list(out.keys()),
        grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        stored=stored,
        pending=store.pending if store else 0,
    )


def train_error(
    ctx, arch, layout, inputs, kwargs, patch=None, only_rank0=False, train=True, config=None
):
    """One forward of a patched model in training (or eval) mode with ``kwargs``; ``(error type,
    message)`` or ``("ok", "")``. ``only_rank0``: the other ranks make no call (the error must come
    before any collective). ``kwargs["shard"]``: names of tensors to shard (inputs="shard")."""
    model = build(arch, 0, **(config or {})).train(train)
    try:
        hf.patch_model(
            model,
            sp=ctx.world,
            group=ctx.group,
            layout=layout,
            inputs=inputs,
            timeout=20,
            **(patch or {}),
        )
    except (ValueError, TypeError) as e:
        return (type(e).__name__, str(e))
    if only_rank0 and ctx.rank != 0:
        return ("skipped", "")
    kw = dict(kwargs)
    for name in kw.pop("shard", ()):
        kw[name] = ringkv.shard(kw[name], 1, layout, ctx.group)
    try:
        model(**kw)
    except (ValueError, TypeError) as e:
        return (type(e).__name__, str(e))
    return ("ok", "")


def helper_from_hidden(ctx):
    """``causal_lm_loss`` from this rank's logits and from its hidden states with the head's weight
    (the base model's output, taken by a hook): both losses, and both forms' gradients of the
    head."""
    model = hf.patch_model(build("llama", 0), group=ctx.group, keep_logits=True)
    seen = []
    model.model.register_forward_hook(lambda m, a, o: seen.append(o.last_hidden_state))
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, ::3] = -100
    out = model(ids, use_cache=False)
    kw = dict(layout="zigzag", group=ctx.group)
    weight = model.lm_head.weight
    by_logits = hf.causal_lm_loss(out.logits, labels, **kw)
    by_hidden = hf.causal_lm_loss(
        seen[0], labels, weight=weight, chunk=3, **kw
    )  # hidden states first
    shifted = hf.causal_lm_loss(
        None,
        shift_labels=targets(labels),
        hidden=seen[0],
        weight=weight,
        num_items_in_batch=7,
        **kw,
    )
    g_logits = torch.autograd.grad(by_logits, weight)[0]
    g_hidden = torch.autograd.grad(by_hidden, weight)[0]
    return dict(
        logits=by_logits.item(),
        hidden=by_hidden.item(),
        shifted=shifted.item(),
        count=int((labels[:, 1:] != -100).sum()),
        g_logits=g_logits,
        g_hidden=g_hidden,
    )


def per_token_step(ctx, arch, seed, ids, labels, layout, opts):
    """A patched training forward with ``per_token=("entropy", "is_top1")`` (``opts``:
    ``position_ids`` of packed rows, ``weights`` of each sequence's (document's) summed log-prob
    in the loss that is backpropagated). Returns the per-token fields gathered into the batch's
    order, the sums ``sequence_sums`` gives and this rank's gradients of ``sum(weights * sums)``."""
    model = build(arch, seed).train()
    hf.patch_model(model, sp=ctx.world, group=ctx.group, layout=layout, loss_chunk=5)
    pos = opts.get("position_ids")
    kw = step_kwargs(ids, labels, "labels", pos)
    out = model(**kw, per_token=("entropy", "is_top1"))
    where = dict(layout=layout, group=ctx.group, position_ids=pos)
    full = {
        name: hf.gather_logits(out[name][..., None].float(), seq_len=ids.shape[1], **where)[..., 0]
        for name in ("log_probs", "entropy", "is_top1", "label_mask")
    }
    sums = hf.sequence_sums(out.log_probs, ctx.group, layout=layout, position_ids=pos)
    (sums * opts["weights"]).sum().backward()
    return dict(
        fields=full,
        keys=list(out.keys()),
        loss=out.loss.item(),
        sums=sums.detach(),
        grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None},
    )


def unpatched_per_token(arch, seed, ids, labels, position_ids, weights):
    """The reference of ``per_token_step`` from the unpatched model's float32 logits: per-token
    log-probs, entropy and top-1 of the shifted labels (0 where -100), each sequence's (or packed
    document's) sum, and the gradients of ``sum(weights * sums)``."""
    model = build(arch, seed).train()
    logits = model(**step_kwargs(ids, labels, "labels", position_ids)).logits.float()
    logp = logits.log_softmax(-1)  # (B, S, V)
    y = targets(labels)  # (B, S)
    mask = y != -100
    picked = logp.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    fields = dict(
        log_probs=torch.where(mask, picked, 0.0),
        entropy=torch.where(mask, -(logp.exp() * logp).sum(-1), 0.0),
        is_top1=(mask & (logits.argmax(-1) == y)).float(),
        label_mask=mask.float(),
    )
    if position_ids is None:
        sums = fields["log_probs"].sum(1)
    else:
        starts = (position_ids.reshape(-1) == 0).cumsum(0) - 1  # the document of each token
        sums = torch.zeros(int(starts[-1]) + 1).index_add(
            0, starts, fields["log_probs"].reshape(-1)
        )
    (sums * weights).sum().backward()
    return fields, sums.detach(), {n: p.grad for n, p in model.named_parameters()}
