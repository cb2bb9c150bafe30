"""Cases for tests/test_hf.py, run on every rank of a gloo world (see tests/dist.py).

Models are built inside each rank from ``(arch, seed)`` (so every rank has the same weights);
the test process builds the same model unpatched as the reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import ringkv  # noqa: E402
from ringkv import hf  # noqa: E402


def build(arch: str, seed: int, **overrides):
    """A tiny random fp32 model (``arch`` in llama/qwen2/mistral) or SmolLM2
    (``arch="smollm2"``)."""
    import transformers

    from tests.models import smollm2_path, tiny_config

    if arch == "smollm2":
        return transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_path(), dtype=torch.float32
        ).eval()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).eval()


def train_step(
    ctx,
    arch,
    seed,
    ids,
    layout,
    inputs,
    give_positions=False,
    checkpointing=False,
    method="ring",
    ulysses=None,
    config=None,
    extra=None,
):
    """Patched forward with labels + backward; returns gathered logits, loss, this rank's grads and
    what the patch runs (``hf.describe``). ``extra``: more ``patch_model`` arguments."""
    # keep_logits: a training-mode forward (checkpointing) returns its logits too, compared below
    model = hf.patch_model(
        build(arch, seed, **(config or {})),
        sp=ctx.world,
        group=ctx.group,
        layout=layout,
        inputs=inputs,
        method=method,
        ulysses=ulysses,
        keep_logits=True,
        **(extra or {}),
    )
    u = hf.patch.patch_state(model).ulysses
    if checkpointing:
        model.train().activation_checkpointing_enable()
    if inputs == "full":
        out = model(ids, labels=ids, use_cache=False)
        helper = hf.causal_lm_loss(out.logits, ids, layout=layout, group=ctx.group, ulysses=u)
    else:
        local = ringkv.shard(ids, 1, layout, ctx.group, rank=ctx.rank, world=ctx.world, ulysses=u)
        kw = {}
        if give_positions:
            kw["position_ids"] = ringkv.positions(
                ids.shape[1], layout, ctx.rank, ctx.world, ulysses=u
            ).unsqueeze(0)
        out = model(local, labels=local, use_cache=False, **kw)
        helper = hf.causal_lm_loss(
            out.logits, local, layout=layout, group=ctx.group, sharded=True, ulysses=u
        )
    out.loss.backward()
    logits = hf.gather_logits(
        out.logits.detach(), layout, ctx.group, seq_len=ids.shape[1], ulysses=u
    )
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return dict(
        logits=logits,
        loss=out.loss.item(),
        helper=helper.item(),
        grads=grads,
        described=hf.describe(model),
    )


def generate(
    ctx, arch, seed, ids, layout, new_tokens, method="ring", ulysses=None, config=None, extra=None
):
    """Greedy generate on the patched model; returns tokens, per-step scores and the cache shard.
    ``extra``: more ``patch_model`` arguments."""
    model = hf.patch_model(
        build(arch, seed, **(config or {})),
        group=ctx.group,
        layout=layout,
        method=method,
        ulysses=ulysses,
        **(extra or {}),
    )
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    cache = out.cache if "cache" in out else out.past_key_values
    return dict(
        tokens=out.sequences,
        scores=torch.stack(out.scores, 1),
        positions=cache.positions.tolist(),
        local_keys=cache.layers[0].keys.shape[2],
        seen=cache.get_seq_length(),
        described=hf.describe(model),
    )


def shard_prefill_decode(ctx, arch, seed, ids, layout, steps):
    """inputs="shard": prefill with this rank's shard and a cache, then decode ``steps`` tokens of
    ``ids`` one at a time; returns the prefill logits (gathered) and each step's logits."""
    s = ids.shape[1] - steps
    model = hf.patch_model(build(arch, seed), group=ctx.group, layout=layout, inputs="shard")
    with torch.no_grad():
        out = model(ringkv.shard(ids[:, :s], 1, layout, ctx.group), use_cache=True)
        prefill = hf.gather_logits(out.logits, layout, ctx.group)
        cache, step_logits = out.cache, []
        for i in range(s, ids.shape[1]):
            out = model(ids[:, i : i + 1], cache=cache)
            cache = out.cache
            step_logits.append(out.logits[:, -1])
    return dict(prefill=prefill, steps=torch.stack(step_logits, 1), local=cache.positions.numel())


def disagree(ctx, arch, seed, ids_per_rank):
    """Each rank calls with its own ids; returns the error message (or 'ok')."""
    model = hf.patch_model(build(arch, seed), group=ctx.group, timeout=20)
    try:
        with torch.no_grad():
            model(ids_per_rank[ctx.rank])
    except ValueError as e:
        return str(e)
    return "ok"


def smollm2(ctx, ids, new_tokens, layout="zigzag"):
    """SmolLM2-135M-Instruct patched over the group: gathered prompt logits and greedy tokens."""
    model = hf.patch_model(build("smollm2", 0), sp=ctx.world, group=ctx.group, layout=layout)
    with torch.no_grad():
        logits = hf.gather_logits(
            model(ids, use_cache=False).logits, layout, ctx.group, seq_len=ids.shape[1]
        )
        tokens = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return dict(logits=logits, tokens=tokens)


def silent_peer(ctx, arch, seed, ids, timeout_s):
    """Rank 0 runs a forward; the other ranks never call. Rank 0 must fail within the timeout."""
    model = hf.patch_model(build(arch, seed), group=ctx.group, timeout=timeout_s)
    if ctx.rank != 0:
        return "skipped"
    return timed_forward(model, ids)


def timed_forward(model, ids):
    """A no-grad forward of ``ids``: ``(error type or "finished", message, seconds)``."""
    import time

    t0 = time.monotonic()
    try:
        with torch.no_grad():
            model(ids)
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return type(e).__name__, str(e), time.monotonic() - t0
    return "finished", "", time.monotonic() - t0


def decode(ctx, q, k, v, q_pos, owner):
    """decode_attention with this rank's keys being those whose ``owner`` is this rank."""
    from ringkv.sp.decode import decode_attention

    mine = (owner == ctx.rank).nonzero().squeeze(1)
    return decode_attention(
        q, k[:, mine], v[:, mine], q_positions=q_pos, k_positions=mine, group=ctx.group
    )


# ---- packed documents and padding masks (tests/test_hf_packed.py) ----


def packed_kwargs(ctx, batch, form, layout, inputs):
    """The model's keyword arguments that describe ``batch``'s packed documents in ``form``:
    ``"position_ids"``, ``"flash"`` (cu_seq_lens_q/k, max_length_q/k), ``"seq_idx"`` or ``"all"``.
    ``inputs="shard"``: cu_seq_lens_q always (the whole packed row's), the rest as this rank's
    shard."""
    cu = torch.tensor(batch["cu"], dtype=torch.int32)
    flash = dict(
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=batch["max_length"],
        max_length_k=batch["max_length"],
    )
    if inputs == "full":
        parts = dict(
            position_ids=dict(position_ids=batch["position_ids"]),
            flash=flash,
            seq_idx=dict(seq_idx=batch["seq_idx"]),
        )
    else:
        total = batch["cu"][-1]
        pos = ringkv.positions(
            total, layout, ctx.rank, ctx.world, cu_seqlens=batch["cu"]
        ).unsqueeze(0)
        idx = ringkv.shard(
            batch["seq_idx"].reshape(1, -1), 1, layout, ctx.group, cu_seqlens=batch["cu"]
        )
        parts = dict(
            position_ids=dict(cu_seq_lens_q=cu, position_ids=pos),
            flash=flash,
            seq_idx=dict(cu_seq_lens_q=cu, seq_idx=idx),
        )
    if form == "all":
        return {k: v for p in parts.values() for k, v in p.items()}
    return parts[form]


def packed_train_step(
    ctx, arch, seed, batch, layout, inputs, form, config=None, checkpointing=False, extra=None
):
    """Patched forward + backward of a packed batch (documents in ``form``); returns the gathered
    logits ``(B, S, V)``, the model's loss, causal_lm_loss's, and this rank's gradients.
    ``extra``: more ``patch_model`` arguments."""
    model = hf.patch_model(
        build(arch, seed, **(config or {})),
        sp=ctx.world,
        group=ctx.group,
        layout=layout,
        inputs=inputs,
        keep_logits=True,
        **(extra or {}),
    )
    if checkpointing:
        model.train().activation_checkpointing_enable()
    ids, labels = batch["ids"], batch["labels"]
    b, s = ids.shape
    kw = packed_kwargs(ctx, batch, form, layout, inputs)
    if inputs == "full":
        out = model(ids, labels=labels, use_cache=False, **kw)
        if form == "flash":  # cu_seqlens: the packed row (1, B*S, V)
            logits = hf.gather_logits(out.logits, layout, ctx.group, cu_seqlens=batch["cu"]).view(
                b, s, -1
            )
            helper = hf.causal_lm_loss(
                out.logits, labels, layout=layout, group=ctx.group, cu_seqlens=batch["cu"]
            )
        else:
            by = (
                dict(seq_idx=batch["seq_idx"])
                if form == "seq_idx"
                else dict(position_ids=batch["position_ids"])
            )
            logits = hf.gather_logits(out.logits, layout, ctx.group, **by)
            helper = hf.causal_lm_loss(out.logits, labels, layout=layout, group=ctx.group, **by)
    else:  # the documented recipe: one packed row, sharded with cu_seqlens
        cu = hf.packed_cu_seqlens(position_ids=batch["position_ids"])
        assert cu == batch["cu"], (cu, batch["cu"])
        local = ringkv.shard(ids.reshape(1, -1), 1, layout, ctx.group, cu_seqlens=cu)
        local_labels = ringkv.shard(labels.reshape(1, -1), 1, layout, ctx.group, cu_seqlens=cu)
        out = model(local, labels=local_labels, use_cache=False, **kw)
        logits = hf.gather_logits(out.logits, layout, ctx.group, cu_seqlens=cu).view(b, s, -1)
        helper = hf.causal_lm_loss(
            out.logits, local_labels, layout=layout, group=ctx.group, sharded=True, cu_seqlens=cu
        )
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return dict(
        logits=logits,
        loss=out.loss.item(),
        helper=helper.item(),
        grads=grads,
        local_rows=out.logits.shape[1],
        cached=out.get("cache") is not None,
        attention=hf.describe(model)["attention"],
    )


def padded_train_step(ctx, arch, seed, ids, mask, labels, layout, inputs, config=None, extra=None):
    """Patched forward + backward of a right-padded batch (``extra``: e.g. the position_ids of
    packed rows, inputs="full"); returns gathered logits, loss, grads."""
    model = hf.patch_model(
        build(arch, seed, **(config or {})),
        sp=ctx.world,
        group=ctx.group,
        layout=layout,
        inputs=inputs,
    )
    extra = extra or {}
    if inputs == "full":
        out = model(ids, attention_mask=mask, labels=labels, **extra)
    else:

        def mine(x):
            return ringkv.shard(x, 1, layout, ctx.group)

        out = model(mine(ids), attention_mask=mine(mask), labels=mine(labels))
    out.loss.backward()
    logits = hf.gather_logits(out.logits, layout, ctx.group, seq_len=ids.shape[1], **extra)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return dict(
        logits=logits, loss=out.loss.item(), grads=grads, cached=out.get("cache") is not None
    )


def forward_error(
    ctx, arch, seed, layout, inputs, kwargs, method="ring", only_rank0=False, config=None
):
    """One patched forward with ``kwargs`` (``kwargs["per_rank"]``: a list of this rank's extra
    kwargs); returns ``(error type, message)`` or ``("ok", "")``. ``only_rank0``: the other ranks
    make no call at all (an error must then come before any collective)."""
    model = hf.patch_model(
        build(arch, seed, **(config or {})),
        sp=ctx.world,
        group=ctx.group,
        layout=layout,
        inputs=inputs,
        method=method,
        timeout=20,
    )
    if only_rank0 and ctx.rank != 0:
        return ("skipped", "")
    kw = dict(kwargs)
    kw.update(kw.pop("per_rank", [{}] * ctx.world)[ctx.rank])
    try:
        model(**kw)
    except (ValueError, TypeError) as e:
        return (type(e).__name__, str(e))
    return ("ok", "")


# ---- data x sequence parallel and torch.compile (tests/test_hf_dp.py) ----

_MESHES: dict = {}


def dp_sp_mesh(dp: int, sp: int):
    """A ``("dp", "sp")`` DeviceMesh over the world (built once per process: its groups are
    reused)."""
    from torch.distributed.device_mesh import init_device_mesh

    if (dp, sp) not in _MESHES:
        _MESHES[(dp, sp)] = init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))
    return _MESHES[(dp, sp)]


def _sum_over(group, tensors) -> None:
    import torch.distributed as dist

    for t in tensors:
        dist.all_reduce(t, group=group)  # SUM


def dp_sp_train(ctx, arch, seed, batches, layout, recipe, sp_arg="mesh_dim", weighted=False):
    """One training step on a ``(dp, sp)`` mesh of the whole world, ``dp = len(batches)``: the SP
    ranks of replica ``d`` pass ``batches[d]`` (labels: ``(ids, labels)`` when a pair). Gradients
    are reduced by ``recipe`` to "sum over sp, mean over dp":

    - ``manual``: all-reduce (sum) over sp, then over dp, divided by dp;
    - ``ddp``: DDP over the dp group (its all-reduce averages over dp), then a sum over sp;
    - ``ddp_all``: DDP over all dp x sp ranks (averages over dp * sp) of ``loss * sp``;
    - ``fsdp``: FSDP2 ``fully_shard`` over ``mesh["dp"]`` (reduce-scatter, mean over dp), then a sum
      over sp of each local shard;
    - ``hsdp``: FSDP2 over the 2-D mesh (replicate over dp, shard over sp; mean over dp * sp) of
      ``loss * sp``.

    ``weighted``: scale each replica's loss by ``dp * n_d / sum(n)`` (``n_d`` its label tokens), so
    that replicas with different token counts give the union's token mean. ``sp_arg``: how the SP
    group is passed (``mesh_dim``: ``group=mesh, mesh_dim="sp"``; ``submesh``: ``group=mesh["sp"]``;
    ``group``: the process group). Returns this rank's loss, coordinates and reduced gradients
    (full).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dp = len(batches)
    sp = ctx.world // dp
    mesh = dp_sp_mesh(dp, sp)
    d, s = mesh.get_coordinate()
    sp_group, dp_group = mesh.get_group("sp"), mesh.get_group("dp")
    model = build(arch, seed).train()
    where = dict(
        mesh_dim=dict(group=mesh, mesh_dim="sp"),
        submesh=dict(group=mesh["sp"]),
        group=dict(group=sp_group),
    )[sp_arg]
    hf.patch_model(model, sp=sp, layout=layout, **where)
    batch = batches[d]
    ids, labels = batch if isinstance(batch, (tuple, list)) else (batch, batch)
    wrapped = model
    if recipe in ("ddp", "ddp_all"):
        wrapped = DDP(model, process_group=dp_group if recipe == "ddp" else ctx.group)
    elif recipe in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        on = mesh["dp"] if recipe == "fsdp" else mesh
        for layer in model.model.layers:
            fully_shard(layer, mesh=on)
        fully_shard(model, mesh=on)
    out = wrapped(ids, labels=labels, use_cache=False)
    scale = 1.0
    if weighted:
        n = (labels[:, 1:] != -100).sum().double()
        total = n.clone()
        dist.all_reduce(total, group=dp_group)
        scale = float(dp * n / total)
    if recipe in ("ddp_all", "hsdp"):
        scale *= sp
    (out.loss * scale).backward()
    params = dict(model.named_parameters())
    if recipe == "manual":
        _sum_over(sp_group, [p.grad for p in params.values()])
        _sum_over(dp_group, [p.grad for p in params.values()])
        for p in params.values():
            p.grad /= dp
    elif recipe == "ddp":
        _sum_over(sp_group, [p.grad for p in params.values()])
    elif recipe == "fsdp":
        _sum_over(sp_group, [p.grad.to_local() for p in params.values()])
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for n, p in params.items()
    }
    return dict(loss=out.loss.item(), dp=d, sp=s, grads=grads)


def mesh_errors(ctx, dp):
    """The ValueErrors of ``patch_model`` for a DeviceMesh without a dim, with a bad dim, and a
    ``mesh_dim`` with a process group (none enters a collective: raised on every rank alone)."""
    mesh = dp_sp_mesh(dp, ctx.world // dp)
    out = []
    for kw in (
        dict(group=mesh),
        dict(group=mesh, mesh_dim="tp"),
        dict(group=mesh, mesh_dim=2),
        dict(group=ctx.group, mesh_dim="sp"),
    ):
        try:
            hf.patch_model(build("llama", 0), **kw)
            out.append("ok")
        except ValueError as e:
            out.append(str(e))
    for kw in (
        dict(group=mesh, mesh_dim=1),
        dict(group=mesh["sp"]),
        dict(group=mesh, mesh_dim="dp"),
    ):
        state = hf.patch_model(build("llama", 0), **kw)._ringkv_state
        out.append((state.rank, state.world, dist_ranks(state.group)))
    return out


def dist_ranks(group):
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def compile_train(ctx, arch, seed, batches, layout, backend="inductor", inputs="full", patch=None):
    """The same patched model eager and under ``torch.compile(model, backend=...)`` for each batch
    (same shape, new data): loss, gathered logits and this rank's grads of both, the compiled
    frame count after each step (a recompile raises after the first step:
    ``error_on_recompile``), and the reasons of the graph breaks."""
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._inductor.config.compile_threads = 1  # no compile worker pool in a test rank
    model = hf.patch_model(
        build(arch, seed), group=ctx.group, layout=layout, inputs=inputs, **(patch or {})
    ).train()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)

    def step(m, ids):
        model.zero_grad(set_to_none=True)
        x = ids if inputs == "full" else ringkv.shard(ids, 1, layout, ctx.group)
        out = m(x, labels=x, use_cache=False)
        out.loss.backward()
        logits = (
            None
            if out.logits is None
            else hf.gather_logits(out.logits, layout, ctx.group, seq_len=ids.shape[1])
        )
        return dict(
            loss=out.loss.item(),
            logits=logits,
            grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )

    steps, frames = [], []
    try:
        for i, ids in enumerate(batches):
            eager = step(model, ids)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = step(compiled, ids)
            steps.append(dict(eager=eager, compiled=got))
            frames.append(counter.frame_count)
        breaks = sorted(k.splitlines()[0] for k in counters["graph_break"])
        recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    finally:
        torch._dynamo.reset()
    return dict(steps=steps, frames=frames, breaks=breaks, recompiles=recompiles)


# ---- left-padded batched generate (tests/test_hf_generate_padded.py) ----


def padded_generate(ctx, arch, seed, ids, mask, layout, new_tokens, config=None):
    """Greedy generate of a left-padded batch on the patched model: tokens, scores and what this
    rank's sharded cache holds (the batch row and position of every cached token)."""
    model = hf.patch_model(build(arch, seed, **(config or {})), group=ctx.group, layout=layout)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    cache = out.cache if "cache" in out else out.past_key_values
    keys = [layer.keys.shape[0] * layer.keys.shape[2] for layer in cache.layers]
    if (
        cache.rows is None
    ):  # no padding (generate drops a mask of ones): every row holds the same positions
        b, pos = ids.shape[0], cache.positions.tolist()
        return dict(
            tokens=out.sequences,
            scores=torch.stack(out.scores, 1),
            rows=[r for r in range(b) for _ in pos],
            positions=pos * b,
            local_keys=keys,
            seen=cache.get_seq_length(),
            lengths=[cache.seen] * b,
        )
    return dict(
        tokens=out.sequences,
        scores=torch.stack(out.scores, 1),
        rows=cache.rows.tolist(),
        positions=cache.positions.tolist(),
        local_keys=keys,
        seen=cache.get_seq_length(),
        lengths=cache.lengths.tolist(),
    )


def padded_decode_error(ctx, arch, ids, mask, bad, only_rank0=False):
    """Prefill a left-padded batch as generate does, then one decode step broken as ``bad`` says
    (``only_rank0``: the other ranks make no decode call). Returns ``(error type, message)``."""
    model = hf.patch_model(build(arch, 0), group=ctx.group, timeout=20)
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        if only_rank0 and ctx.rank != 0:
            return ("skipped", "")
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        grown = torch.cat([mask, torch.ones_like(nxt)], 1)
        step = dict(attention_mask=grown, position_ids=pos[:, -1:] + 1)
        if bad == "pattern":  # the pad pattern changes
            step["attention_mask"] = grown.roll(1, 1)
        elif bad == "no_mask":
            step.pop("attention_mask")
        elif bad == "new_pad":  # a new token marked as a pad
            step["attention_mask"] = torch.cat([mask, torch.zeros_like(nxt)], 1)
        elif bad == "positions":
            step["position_ids"] = torch.full_like(nxt, ids.shape[1])
        elif bad == "short":  # the mask of the prompt only
            step["attention_mask"] = mask
        try:
            model(nxt, cache=out.cache, use_cache=True, **step)
        except (ValueError, TypeError) as e:
            return (type(e).__name__, str(e))
    return ("ok", "")
