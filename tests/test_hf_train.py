"""Training at any length: the chunked loss (no logits), per-token log-probs (``per_token=``,
``sequence_sums``), the tiled MLP and offloaded checkpoints of ``ringkv.patch_model``, against the
unpatched model (loss and gradients, summed over the SP group)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import ringkv
from ringkv import hf
from ringkv.kernels.linear_ce import default_chunk, linear_cross_entropy, linear_log_probs
from ringkv.memory import FileStore
from tests.hf_cases import build
from tests.train_cases import targets, unpatched_per_token, unpatched_step

_SETTINGS = dict(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None
)


def _close_grads(res, grads, scale_tol=2e-5):
    assert set(res[0]["grads"]) == set(grads), (sorted(res[0]["grads"]), sorted(grads))
    for name, want in grads.items():  # summed over the SP group, as an all-reduce would
        total = sum(r["grads"][name] for r in res)
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(
            total, want, atol=scale_tol * scale, rtol=1e-4, msg=lambda m: f"grad {name}: {m}"
        )


def _labels(ids, density, seed):
    """``ids`` with a fraction ``density`` of the labels -100 (token 1's label always counted)."""
    g = torch.Generator().manual_seed(seed)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < density] = -100
    labels[:, 1] = ids[:, 1]
    return labels


def _packed_positions(b, s, seed):
    """``(B, S)`` position ids restarting at 0 for each packed document (random lengths)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        pos, left = [], s
        while left:
            n = int(torch.randint(1, left + 1, (1,), generator=g))
            pos += list(range(n))
            left -= n
        rows.append(pos)
    return torch.tensor(rows)


# ---- the kernel -------------------------------------------------------------------------------


@settings(max_examples=25, **_SETTINGS)
@given(
    n=st.integers(1, 70),
    h=st.integers(1, 24),
    v=st.integers(2, 90),
    chunk=st.one_of(st.none(), st.integers(1, 80)),
    density=st.floats(0, 1),
    bias=st.booleans(),
    softcap=st.sampled_from([None, 0.5, 30.0]),
    scale=st.sampled_from([None, 0.25, 3.0]),
    seed=st.integers(0, 10**6),
)
def test_linear_cross_entropy_equals_the_head_then_cross_entropy(
    n, h, v, chunk, density, bias, softcap, scale, seed
):
    """Sum, d hidden, d weight and d bias equal F.linear + (scale, softcap) + cross_entropy(sum)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < density] = -100
    z = F.linear(hidden, weight, b).float()
    z = z if scale is None else z * scale
    z = z if softcap is None else torch.tanh(z / softcap) * softcap
    want = F.cross_entropy(z, y, reduction="sum", ignore_index=-100)
    grad_out = torch.rand((), generator=g) + 0.5
    want_grads = torch.autograd.grad(want * grad_out, [hidden, weight] + ([b] if bias else []))
    got = linear_cross_entropy(hidden, weight, y, b, chunk=chunk, softcap=softcap, scale=scale)
    got_grads = torch.autograd.grad(got * grad_out, [hidden, weight] + ([b] if bias else []))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    for a, w in zip(got_grads, want_grads):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


@settings(max_examples=30, **_SETTINGS)
@given(
    n=st.integers(1, 70),
    h=st.integers(1, 24),
    v=st.integers(2, 90),
    chunk=st.one_of(st.none(), st.integers(1, 80)),
    density=st.floats(0, 1),
    bias=st.booleans(),
    softcap=st.sampled_from([None, 0.5, 30.0]),
    scale=st.sampled_from([None, 0.25, 3.0]),
    temperature=st.sampled_from([1.0, 0.7]),
    fields=st.sampled_from(["log_probs", "entropy", "both"]),  # what the backward sees
    seed=st.integers(0, 10**6),
)
def test_linear_log_probs_equals_log_softmax_gather_in_float64(
    n, h, v, chunk, density, bias, softcap, scale, temperature, fields, seed
):
    """Log-probs, entropy, top-1 and mean logit of every row, and the gradients of a random
    weighting of the log-probs and/or entropies, equal ``log_softmax(z).gather(target)`` (and
    ``z.mean(-1)``) of the whole logits in float64 (the head, scale, softcap and temperature
    applied; rows with target -100 give 0)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < density] = -100
    leaves = [hidden, weight] + ([b] if bias else [])
    d = [x.detach().double().requires_grad_() for x in leaves]
    z = F.linear(d[0], d[1], d[2] if bias else None)
    z = z if scale is None else z * scale
    z = z if softcap is None else torch.tanh(z / softcap) * softcap
    z = z / temperature
    logp, valid = z.log_softmax(-1), y != -100
    want = torch.where(valid, logp.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
    want_ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    got = linear_log_probs(
        hidden, weight, y, b, chunk=chunk, softcap=softcap, scale=scale,
        temperature=temperature, entropy=True, top1=True, mean_logits=True,
    )  # fmt: skip
    assert got.log_probs.dtype == got.entropy.dtype == got.mean_logits.dtype == torch.float32
    want_mean = torch.where(valid, z.mean(-1), 0.0)  # TRL's logits/* metrics; no gradient
    torch.testing.assert_close(got.mean_logits.double(), want_mean, atol=2e-5, rtol=1e-5)
    assert not got.mean_logits.requires_grad
    torch.testing.assert_close(got.log_probs.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy.double(), want_ent, atol=2e-5, rtol=1e-5)
    top2 = z.topk(min(2, v), -1).values
    clear = (top2[:, 0] - top2[:, -1] > 1e-4) | (v == 1)  # no near-tie for the argmax
    top1 = valid & (z.argmax(-1) == y)
    assert torch.equal(got.is_top1[clear], top1[clear]) and not got.is_top1[~valid].any()
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    use_lp, use_ent = fields in ("log_probs", "both"), fields in ("entropy", "both")

    def weighted(lp, ent, w_lp, w_ent):
        return (lp * w_lp).sum() * use_lp + (ent * w_ent).sum() * use_ent

    got_grads = torch.autograd.grad(weighted(*got[:2], w_lp, w_ent), leaves)
    want_grads = torch.autograd.grad(weighted(want, want_ent, w_lp.double(), w_ent.double()), d)
    for a, w in zip(got_grads, want_grads):
        atol = 2e-5 * max(1.0, w.abs().max().item())
        torch.testing.assert_close(a.double(), w, atol=atol, rtol=1e-4)


def test_linear_cross_entropy_bf16_accumulates_in_float32():
    """bf16 head and hidden states: the sum equals the float32 loss of the bf16 logits (what HF
    computes: the head in bf16, then .float()), and d weight is accumulated in float32 over 64
    chunks: closer to the float32 gradient than the unfused bf16 gradient is."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, 32, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(300, 32, generator=g) / 4).bfloat16().requires_grad_()
    y = torch.randint(0, 300, (512,), generator=g)
    ref_loss = F.cross_entropy(F.linear(hidden, weight).float(), y, reduction="sum")
    dh_ref, dw_ref = torch.autograd.grad(ref_loss, [hidden, weight])
    got = linear_cross_entropy(hidden, weight, y, chunk=8)
    dh, dw = torch.autograd.grad(got, [hidden, weight])
    assert got.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref_loss, rtol=1e-5, atol=1e-3)
    exact = F.cross_entropy(
        F.linear(hidden.float(), weight.float()), y, reduction="sum"
    )  # all float32
    dh32, dw32 = torch.autograd.grad(
        exact, [hidden, weight]
    )  # grads of the bf16 leaves, float32 math
    assert (dw.float() - dw32.float()).abs().max() <= (
        dw_ref.float() - dw32.float()
    ).abs().max() * 1.01
    torch.testing.assert_close(dh.float(), dh_ref.float(), rtol=2e-2, atol=2e-2)


def _head_loss(kind, hidden, weight, y, chunk):
    """The chunked head's scalar to backpropagate: ``linear_cross_entropy``'s, or
    ``linear_log_probs``' log-probs plus entropies (both gradients)."""
    if kind == "cross_entropy":
        return linear_cross_entropy(hidden, weight, y, chunk=chunk)
    out = linear_log_probs(hidden, weight, y, chunk=chunk, entropy=True, top1=True)
    return out.log_probs.sum() + out.entropy.sum()


@pytest.mark.parametrize("kind", ["cross_entropy", "log_probs"])
def test_linear_head_keeps_at_most_one_chunk_of_logits(kind):
    """The peak allocation of forward + backward grows with the chunk, not with the tokens: 4x the
    tokens at the same chunk add only the (N, H) hidden-state gradient (and (N,) rows), never
    (N, V) logits; for the cross-entropy and for the per-token log-probs with their entropy."""
    from benchmarks.train_memory import (
        _profiled_peak,
    )  # the benchmark's own CPU allocator accounting

    def peak(n, chunk):
        g = torch.Generator().manual_seed(n)
        hidden = torch.randn(n, 16, generator=g, requires_grad=True)
        weight = torch.randn(4096, 16, generator=g, requires_grad=True)
        y = torch.randint(0, 4096, (n,), generator=g)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            _head_loss(kind, hidden, weight, y, chunk).backward()
        return _profiled_peak(prof)

    logits_bytes = 4096 * 4
    small, large = peak(256, 32), peak(1024, 32)
    assert large - small < 768 * logits_bytes / 8, (
        small,
        large,
    )  # far below 768 more rows of logits
    assert peak(1024, 256) - large > 100 * logits_bytes  # a larger chunk does cost more
    assert default_chunk(49152) * 49152 * 4 <= 64 * 2**20 and default_chunk(10**9) == 16


# ---- the patched model on the gloo world -------------------------------------------------------


@settings(max_examples=10, **_SETTINGS)
@given(
    arch=st.sampled_from(["llama", "qwen2", "mistral"]),
    sp=st.integers(1, 3),
    layout=st.sampled_from(ringkv.LAYOUTS),
    s=st.integers(3, 40),
    b=st.integers(1, 2),
    chunk=st.one_of(st.none(), st.integers(1, 30)),
    tie=st.booleans(),
    density=st.floats(0, 0.9),
    packed=st.booleans(),
    form=st.sampled_from(["labels", "shift", "both"]),
    num_items=st.one_of(st.none(), st.integers(1, 100)),
    seed=st.integers(0, 1000),
)
def test_chunked_loss_equals_the_unpatched_model(
    world, arch, sp, layout, s, b, chunk, tie, density, packed, form, num_items, seed
):
    """Training mode with labels (or shift_labels, or both): no logits come back, and the loss and
    the SP-summed gradients equal the unpatched model's, over lengths, loss chunks, packed
    documents, ignore-index density, tied or untied heads and HF's num_items_in_batch."""
    ids = torch.randint(3, 128, (b, s), generator=torch.Generator().manual_seed(seed))
    labels = _labels(ids, density, seed)
    pos = _packed_positions(b, s, seed) if packed else None
    config = dict(tie_word_embeddings=tie)
    loss, grads = unpatched_step(arch, seed, ids, labels, form, pos, num_items, config)
    opts = dict(
        form=form,
        position_ids=pos,
        num_items=num_items,
        config=config,
        patch=dict(loss_chunk=chunk),
    )
    res = world.check(
        "tests.train_cases:chunked_step", sp, arch, seed, ids, labels, layout, "full", opts
    )
    for r in res:
        assert not r["logits"] and "logits" not in r["keys"], r["keys"]
        assert r["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), (r["loss"], loss)
    _close_grads(res, grads)


@pytest.mark.parametrize(
    "sp,layout,form", [(2, "zigzag", "labels"), (3, "striped", "shift"), (2, "contiguous", "both")]
)
def test_chunked_loss_with_sharded_inputs(world, sp, layout, form):
    """inputs="shard": this rank's shard of the labels (or shift_labels) and of the tokens."""
    s = 6 * sp
    ids = torch.randint(3, 128, (2, s), generator=torch.Generator().manual_seed(s))
    labels = _labels(ids, 0.3, s)
    loss, grads = unpatched_step("llama", 1, ids, labels, form, num_items=17)
    res = world.check(
        "tests.train_cases:chunked_step",
        sp,
        "llama",
        1,
        ids,
        labels,
        layout,
        "shard",
        dict(form=form, num_items=17, patch=dict(loss_chunk=5)),
    )
    for r in res:
        assert not r["logits"] and r["loss"] == pytest.approx(loss, rel=1e-5)
    _close_grads(res, grads)


@settings(max_examples=10, **_SETTINGS)
@given(
    sp=st.integers(1, 3),
    layout=st.sampled_from(ringkv.LAYOUTS),
    s=st.integers(3, 30),
    b=st.integers(1, 2),
    density=st.floats(0, 0.8),
    packed=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_per_token_log_probs_equal_the_unpatched_model(
    world, sp, layout, s, b, density, packed, seed
):
    """per_token=("entropy", "is_top1") on sp ranks: every token's log-prob, entropy, top-1 hit
    and label mask (gathered from the shards) equal those of the unpatched model's logits, with the
    shift across shard boundaries; sequence_sums gives every sequence's (packed document's) sum on
    every rank, and the gradients of a weighting of those sums, summed over the SP group, are the
    unpatched model's."""
    ids = torch.randint(3, 128, (b, s), generator=torch.Generator().manual_seed(seed))
    labels = _labels(ids, density, seed)
    pos = _packed_positions(b, s, seed) if packed else None
    docs = int((pos == 0).sum()) if packed else b
    weights = torch.randn(docs, generator=torch.Generator().manual_seed(seed))
    fields, sums, grads = unpatched_per_token("llama", seed, ids, labels, pos, weights)
    opts = dict(position_ids=pos, weights=weights)
    res = world.check(
        "tests.train_cases:per_token_step", sp, "llama", seed, ids, labels, layout, opts
    )
    for r in res:
        assert "logits" not in r["keys"] and "loss" in r["keys"], r["keys"]
        for name, want in fields.items():
            torch.testing.assert_close(r["fields"][name], want, atol=2e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(r["sums"], sums, atol=1e-4, rtol=1e-5)
    _close_grads(res, grads)


@settings(max_examples=6, **_SETTINGS)
@given(
    tile=st.integers(1, 20),
    ckpt=st.sampled_from([None, "reentrant", "plain"]),
    sp=st.integers(1, 2),
    s=st.integers(4, 40),
    seed=st.integers(0, 1000),
)
def test_tiled_mlp_is_exact(world, tile, ckpt, sp, s, seed):
    """tile_mlp=T: loss and gradients equal the unpatched model's, with and without HF's activation
    checkpointing (both kinds)."""
    ids = torch.randint(3, 128, (1, s), generator=torch.Generator().manual_seed(seed))
    loss, grads = unpatched_step("qwen2", seed, ids, ids)
    res = world.check(
        "tests.train_cases:chunked_step",
        sp,
        "qwen2",
        seed,
        ids,
        ids,
        "zigzag",
        "full",
        dict(patch=dict(tile_mlp=tile), checkpointing=ckpt),
    )
    for r in res:
        assert r["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    _close_grads(res, grads)


def test_tiled_mlp_runs_tiles_and_undoes():
    """The MLP is called once per tile in forward and again per tile in backward; unpatch_model
    restores it."""
    model = build("llama", 0).train()
    calls = []
    mlp = model.model.layers[0].mlp
    mlp.down_proj.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    hf.patch_model(model, tile_mlp=4)
    ids = torch.randint(3, 128, (1, 10))
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert calls == [4, 4, 2, 4, 4, 2], calls
    hf.unpatch_model(model)
    calls.clear()
    model(ids, labels=ids, use_cache=False)
    assert calls == [10] and "forward" not in vars(mlp)


@pytest.mark.parametrize("ckpt", ["reentrant", "plain"])
def test_offloaded_checkpoints_come_back_for_backward(world, ckpt):
    """offload_checkpoints=FileStore(): every layer's input (B, S/N, H) goes to the store in forward
    and comes back in backward (nothing left behind), and the gradients are the unpatched model's,
    with the tiled MLP too."""
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    loss, grads = unpatched_step("llama", 0, ids, ids)
    res = world.check(
        "tests.train_cases:chunked_step",
        2,
        "llama",
        0,
        ids,
        ids,
        "zigzag",
        "full",
        dict(store=True, checkpointing=ckpt, patch=dict(tile_mlp=3)),
    )
    layers = build("llama", 0).config.num_hidden_layers
    for r in res:
        assert r["loss"] == pytest.approx(loss, rel=1e-5)
        hidden_shaped = [shape for shape, _ in r["stored"] if shape == (2, 8, 64)]
        assert len(hidden_shaped) >= layers, r["stored"]
        assert r["pending"] == 0
    _close_grads(res, grads)


# ---- other model families, bf16, keep_logits, the public form ---------------------------------

FAMILIES = {  # transformers class prefix: config overrides (tiny)
    "Gemma": dict(head_dim=16),
    "Gemma2": dict(
        head_dim=16,
        attn_logit_softcapping=0.05,
        query_pre_attn_scalar=1,
        final_logit_softcapping=0.1,  # the head's logits too are past it at init
        sliding_window=8,
    ),  # scale 1: scores ~0.1 at init, past the cap
    "Cohere": dict(logit_scale=0.25),
    "Granite": dict(logits_scaling=4.0),
    "Phi3": dict(),
    "Qwen3": dict(head_dim=16),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_train_like_unpatched(family):
    """Heads that transform their logits (Gemma 2's soft-cap, Cohere's and Granite's scales), fused
    MLPs (Phi-3), q/k norms (Qwen3), attention soft-capping (Gemma 2): the chunked loss and the
    tiled MLP equal the unpatched model, and so do per_token's entropy and log-probs."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, family + "Config")(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        **FAMILIES[family],
    )
    model = getattr(transformers, family + "ForCausalLM")(config).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 160, (2, 24), generator=torch.Generator().manual_seed(1))
    want = ref(ids, labels=ids, use_cache=False)
    want.loss.backward()
    hf.patch_model(model, loss_chunk=7, tile_mlp=5)
    got = model(ids, labels=ids, use_cache=False)
    got.loss.backward()
    assert got.logits is None
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, atol=2e-6, rtol=1e-4, msg=lambda m: f"{family} {name}: {m}"
        )
    # per_token's entropy and log-probs through the same head transform (eval, no logits)
    with torch.no_grad():
        stats = model.eval()(ids, labels=ids, per_token=("entropy",))
    logp = want.logits.detach().float().log_softmax(-1)[:, :-1]  # (B, S - 1, V)
    entropy = -(logp.exp() * logp).sum(-1)
    picked = logp.gather(-1, ids[:, 1:, None])[..., 0]
    assert stats.logits is None
    torch.testing.assert_close(stats.entropy[:, :-1], entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.log_probs[:, :-1], picked, atol=1e-5, rtol=1e-5)


def test_bf16_weights_train_like_unpatched():
    """bf16 weights: the chunked loss (float32 inside) is within bf16 rounding of the unpatched bf16
    model's, and both are near the float32 model's loss."""
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(5))
    loss32, _ = unpatched_step("llama", 0, ids, ids)
    loss16, grads16 = unpatched_step("llama", 0, ids, ids, dtype=torch.bfloat16)
    model = build("llama", 0).to(torch.bfloat16).train()
    hf.patch_model(model, loss_chunk=9)
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert out.logits is None and out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(loss16, rel=2e-3) and out.loss.item() == pytest.approx(
        loss32, rel=1e-2
    )
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.bfloat16
        scale = grads16[name].float().abs().max().item()
        torch.testing.assert_close(
            p.grad.float(),
            grads16[name].float(),
            atol=0.05 * scale + 1e-3,
            rtol=0.05,
            msg=lambda m: f"{name}: {m}",
        )


def test_per_token_temperature_divides_the_logits():
    """per_token_temperature=T (TRL's GRPO at a sampling temperature): log-probs and entropies of
    the logits divided by T, and their gradients, as the unpatched model's; refused without
    per_token or when not a positive float."""
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(7))
    ref = build("llama", 0).train()
    logp = (ref(ids).logits.float()[:, :-1] / 0.7).log_softmax(-1)  # (B, S - 1, V)
    want = logp.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    (want.sum() + entropy.sum()).backward()
    model = hf.patch_model(build("llama", 0).train())
    out = model(ids, labels=ids, per_token="entropy", per_token_temperature=0.7, use_cache=False)
    torch.testing.assert_close(out.log_probs[:, :-1], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy[:, :-1], entropy, atol=1e-5, rtol=1e-5)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: name + m)
    for kw, match in (
        (dict(per_token_temperature=0.7), "needs per_token"),
        (dict(per_token=True, per_token_temperature=0.0), "positive float"),
        (dict(per_token=True, per_token_temperature=True), "positive float"),
    ):
        with pytest.raises(ValueError, match=match):
            model(ids, labels=ids, use_cache=False, **kw)


def test_cpu_bf16_autocast_trains_and_generates_like_unpatched():
    """fp32 weights under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (Trainer's and TRL's
    bf16=True on CPU): the rotary embedding gives q and k back in float32 while v stays bf16; the
    patched attention runs them in the autocast dtype, as transformers' SDPA does. Loss and
    gradients within bf16 rounding of the unpatched model under the same autocast, greedy tokens
    equal."""
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(6))
    results = []
    for patched in (False, True):
        model = build("llama", 0).train()
        if patched:
            hf.patch_model(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids, use_cache=False)
            out.loss.backward()
            tokens = model.eval().generate(ids[:, :8], max_new_tokens=4, do_sample=False)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((out.loss.item(), grads, tokens))
    (loss0, grads0, tokens0), (loss1, grads1, tokens1) = results
    assert loss1 == pytest.approx(loss0, rel=1e-2)
    assert torch.equal(tokens1, tokens0)
    for name, want in grads0.items():
        scale = want.abs().max().item()
        torch.testing.assert_close(
            grads1[name], want, atol=0.05 * scale + 1e-3, rtol=0.05, msg=lambda m: f"{name}: {m}"
        )


def test_keep_logits_modes():
    """None: logits in eval, none in training with labels; True: always; False: never with
    labels."""
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    want = build("llama", 0)(ids, labels=ids, use_cache=False)
    for keep, train, has in [
        (None, True, False),
        (None, False, True),
        (True, True, True),
        (False, False, False),
    ]:
        model = hf.patch_model(build("llama", 0).train(train), keep_logits=keep)
        out = model(ids, labels=ids, use_cache=False)
        assert (out.logits is not None) == has, (keep, train)
        assert out.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
        if has:
            torch.testing.assert_close(out.logits, want.logits, atol=1e-5, rtol=1e-5)
    model = hf.patch_model(build("llama", 0).train(), keep_logits=None)
    out = model(
        ids, labels=ids, use_cache=False, logits_to_keep=3
    )  # training, kept logits asked for: given
    torch.testing.assert_close(out.logits, want.logits[:, -3:], atol=1e-5, rtol=1e-5)
    assert out.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)


def test_causal_lm_loss_from_hidden_states(world):
    """causal_lm_loss(None, labels, hidden=, weight=) on the base model's shards equals the loss of
    the logits, with shift_labels and num_items_in_batch."""
    res = world.check("tests.train_cases:helper_from_hidden", 2)
    for r in res:
        assert r["hidden"] == pytest.approx(r["logits"], rel=1e-6)
        assert r["shifted"] == pytest.approx(r["logits"] * r["count"] / 7, rel=1e-6)
    torch.testing.assert_close(
        sum(r["g_hidden"] for r in res), sum(r["g_logits"] for r in res), atol=1e-6, rtol=1e-5
    )


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(num_items_in_batch=0), "num_items_in_batch"),
        (dict(num_items_in_batch=torch.tensor(-3)), "num_items_in_batch"),
        (dict(num_items_in_batch=float("nan")), "num_items_in_batch"),
        (dict(shift_labels="wrong"), "shift_labels"),
        (dict(per_token="logits"), "per_token"),
        (dict(per_token=("entropy", 3)), "per_token"),
    ],
)
def test_bad_loss_arguments_fail_before_any_collective(world, kwargs, name):
    """Only rank 0 makes the call: its error comes before any collective (else it would wait)."""
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    if kw.get("shift_labels") == "wrong":
        kw["shift_labels"] = targets(ids).roll(1, 1)
    res = world.check("tests.train_cases:train_error", 2, "llama", "zigzag", "full", kw, None, True)
    assert res[0][0] == "ValueError" and name in res[0][1], res[0]
    assert res[1] == ("skipped", "")


@pytest.mark.parametrize("train,patch", [(False, None), (True, dict(keep_logits=True))])
def test_labels_with_logits_to_keep_over_logits_fail_before_any_collective(world, train, patch):
    """A loss from the logits needs every token's: with logits_to_keep only the kept ones are
    built, so the call is refused by rank 0 alone (a clear error, not the cross-entropy's)."""
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, labels=ids, use_cache=False, logits_to_keep=3)
    res = world.check(
        "tests.train_cases:train_error", 2, "llama", "zigzag", "full", kw, patch, True, train
    )
    assert res[0][0] == "ValueError" and "logits_to_keep=3" in res[0][1], res[0]
    assert res[1] == ("skipped", "")


def test_shift_labels_that_disagree_in_shards_fail_on_every_rank(world):
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(
        input_ids=ids,
        labels=ids,
        shift_labels=ids,
        use_cache=False,
        shard=("input_ids", "labels", "shift_labels"),
    )
    res = world.check("tests.train_cases:train_error", 2, "llama", "zigzag", "shard", kw)
    assert all(r[0] == "ValueError" and "shift_labels" in r[1] for r in res), res


def test_bad_patch_options_are_clear_errors(world):
    ids = torch.randint(3, 128, (1, 12))
    # keep_logits=False: logits_to_keep in eval asks for what is never built
    res = world.check(
        "tests.train_cases:train_error",
        2,
        "llama",
        "zigzag",
        "full",
        dict(input_ids=ids, logits_to_keep=1),
        dict(keep_logits=False),
        True,
        False,
    )
    assert (
        res[0][0] == "ValueError" and "keep_logits" in res[0][1] and "logits_to_keep" in res[0][1]
    ), res
    # offload_checkpoints=True on a CPU; offloading without checkpointing
    res = world.check(
        "tests.train_cases:train_error",
        2,
        "llama",
        "zigzag",
        "full",
        {},
        dict(offload_checkpoints=True),
    )
    assert all(
        r[0] == "ValueError" and "offload_checkpoints" in r[1] and "cpu" in r[1] for r in res
    ), res
    res = world.check(
        "tests.train_cases:train_error",
        2,
        "llama",
        "zigzag",
        "full",
        dict(input_ids=ids, labels=ids, use_cache=False),
        dict(offload_checkpoints=FileStore()),
        True,
    )
    assert (
        res[0][0] == "ValueError"
        and "offload_checkpoints" in res[0][1]
        and "checkpointing" in res[0][1]
    ), res
    # per_token without targets, or with logits kept: refused by rank 0 alone, before any collective
    for kw, patch, why in [
        (dict(input_ids=ids, per_token=True), None, "labels or shift_labels"),
        (dict(input_ids=ids, labels=ids, per_token=True), dict(keep_logits=True), "keep_logits"),
    ]:
        res = world.check(
            "tests.train_cases:train_error", 2, "llama", "zigzag", "full", kw, patch, True
        )
        assert res[0][0] == "ValueError" and "per_token" in res[0][1] and why in res[0][1], res
        assert res[1] == ("skipped", "")
    for bad in (0, -1, 2.5, "yes"):
        with pytest.raises(ValueError, match="tile_mlp"):
            hf.patch_model(build("llama", 0), tile_mlp=bad)
    with pytest.raises(ValueError, match="loss_chunk"):
        hf.patch_model(build("llama", 0), loss_chunk=0)


def test_tile_mlp_on_an_unrecognised_mlp_is_a_value_error():
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
    )
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(ValueError, match="tile_mlp.*MixtralSparseMoeBlock"):
        hf.patch_model(model, tile_mlp=True)
    assert getattr(model, "_ringkv_state", None) is None  # nothing was patched
    hf.patch_model(model)  # without tiling it patches (the loss is chunked, the experts untouched)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_to_pinned_host_memory_on_cuda():
    """offload_checkpoints=True on CUDA: the same loss and gradients as without offload, and the
    layer inputs leave the device between forward and backward."""
    model = build("llama", 0).cuda().train()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 256), device="cuda")
    for m in (model, ref):
        m.gradient_checkpointing_enable()
    hf.patch_model(model, offload_checkpoints=True, tile_mlp=64)
    hf.patch_model(ref, tile_mlp=64)
    want = ref(ids, labels=ids, use_cache=False)
    want.loss.backward()
    for p in ref.parameters():
        p.grad = None
    before = torch.cuda.memory_allocated()
    got = model(ids, labels=ids, use_cache=False)
    with_offload = torch.cuda.memory_allocated() - before
    got.loss.backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kept = ref(ids, labels=ids, use_cache=False)
    without = torch.cuda.memory_allocated() - before
    layer_inputs = model.config.num_hidden_layers * ids.numel() * model.config.hidden_size * 4
    assert without - with_offload >= layer_inputs, (
        without,
        with_offload,
        layer_inputs,
    )  # they left the GPU
    kept.loss.backward()
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)


def test_a_dropped_graph_frees_its_offloaded_checkpoints():
    """Offloaded tensors of a graph whose backward never runs (an aborted step) are not kept by the
    store: each handle owns its copy and dies with the graph (HostStore's pinned copies alike);
    a backward reads each back once. Only (B, S, H) floating tensors are offloaded."""
    from ringkv.memory import offload_checkpoints

    store = FileStore()
    w = torch.randn(8, requires_grad=True)
    for backward in (False, True):
        x = torch.randn(2, 5, 8, requires_grad=True)
        with offload_checkpoints(store, hidden=8):
            y = (x.sin() * 2).cos().sum() + (
                w * 3
            ).sin().sum()  # sin saves x, cos 2 sin(x); w's stay
        assert store.pending == 2
        if backward:
            y.backward()
            torch.testing.assert_close(x.grad, -(2 * x.sin()).sin() * 2 * x.cos())
        del y
        assert store.pending == 0
    directory = store.directory
    del store
    assert not os.path.exists(directory)  # a store's own temporary directory goes with it


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_liger_path_on_cuda_equals_the_chunked_loss():
    """With liger-kernel installed, the CUDA loss goes through Liger's fused linear cross-entropy;
    either way it equals the unpatched model's loss and gradients."""
    pytest.importorskip("liger_kernel")
    model = build("llama", 0).cuda().train()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 128), device="cuda")
    want = ref(ids, labels=ids, use_cache=False)
    want.loss.backward()
    hf.patch_model(model)
    got = model(ids, labels=ids, use_cache=False)
    got.loss.backward()
    assert got.logits is None and got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
