"""World cases for tests/test_hf_families.py: ``ringkv.patch_model`` on tiny random gpt-oss
(attention sinks, alternating sliding and full layers, MoE), Gemma 2 (attention and final logit
soft-capping, sliding window) and DeepSeek-V3 (MLA: a V head size of its own, a cache of compressed
latents, MoE), run on every rank of the case's group.

Models are built from ``(family, seed)`` in every process (the same weights everywhere); the test
process builds the same model unpatched as the reference. Their MoE routers pick every expert
(``num_experts_per_tok`` = the number of experts): routing is then a smooth function of the hidden
states, and an SP run's rounding cannot flip a top-k choice.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ringkv import hf  # noqa: E402
from tests.hf_cases import packed_kwargs  # noqa: E402

FAMILIES = ("gpt_oss", "gemma2", "deepseek_v3")
MORE = (
    "gemma3_text",
    "qwen3_moe",
    "mla_wide",
)  # trained once each: q/k norms with windows, MoE, MLA of other widths


def config(family: str, **overrides):
    """A tiny transformers config of ``family`` (hidden 64, 2 layers, 4 heads, vocab 128) whose
    feature of interest changes the output: gpt-oss slides (window 4) on layer 0 and not on
    layer 1; Gemma 2 caps its attention scores at 2.0 (and its logits at 0.5) and slides on layer
    0 (window 4); DeepSeek-V3's queries and keys have 16 + 8 = 24 dims and its values 16."""
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    if family == "gpt_oss":
        common.update(
            intermediate_size=32,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
                rope_theta=150000.0,
            ),
        )
        cls = transformers.GptOssConfig
    elif family == "gemma2":
        common.update(
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=0.5,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
        cls = transformers.Gemma2Config
    elif (
        family == "deepseek_v3"
    ):  # MLA's key heads are all query heads (kv_b_proj expands the latent per head)
        common.update(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=2,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        )
        cls = transformers.DeepseekV3Config
    elif family == "gemma3_text":
        common.update(
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
        cls = transformers.Gemma3TextConfig
    elif family == "qwen3_moe":
        common.update(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=2,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
        )
        cls = transformers.Qwen3MoeConfig
    elif (
        family == "mla_wide"
    ):  # DeepSeek-V3's MLA with a q LoRA, qk 32 + 16 = 48 and v 24 (Kimi-K2's shape of it)
        common.update(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=4,
            kv_lora_rank=48,
            q_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=2,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        )
        cls = transformers.DeepseekV3Config
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES + MORE}")
    common.update(overrides)
    return cls(**common)


def build(family: str, seed: int, **overrides):
    """The tiny fp32 model of ``family`` (eval mode), the same for a seed in every process, with
    weights that make its features bite: gpt-oss's sinks drawn from [-2, 2] (init: ~0.02);
    Gemma 2's q/k projections x8 (scores of a few units, past the cap of 2.0)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config(family, **overrides), dtype=torch.float32
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if family == "gpt_oss":
                attn.sinks.copy_(torch.rand(attn.sinks.shape, generator=g) * 4 - 2)
            if family == "gemma2":
                attn.q_proj.weight.mul_(8)
                attn.k_proj.weight.mul_(8)
    return model.eval()


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def train_step(ctx, family, seed, ids, layout, method="ring", ulysses=None):
    """A patched training forward (labels, ``inputs="full"``) and backward: the gathered logits
    ``(B, S, V)``, the model's loss and ``causal_lm_loss``'s, and this rank's gradients."""
    model = hf.patch_model(
        build(family, seed),
        sp=ctx.world,
        group=ctx.group,
        layout=layout,
        method=method,
        ulysses=ulysses,
        keep_logits=True,
    ).train()
    u = ulysses or 1
    out = model(ids, labels=ids, use_cache=False)
    helper = hf.causal_lm_loss(out.logits, ids, layout=layout, group=ctx.group, ulysses=u)
    out.loss.backward()
    logits = hf.gather_logits(
        out.logits.detach(), layout, ctx.group, seq_len=ids.shape[1], ulysses=u
    )
    return dict(
        logits=logits,
        loss=out.loss.item(),
        helper=helper.item(),
        grads=_grads(model),
        cached=out.get("cache") is not None,
    )


def packed_train_step(ctx, family, seed, batch, layout, form):
    """Patched forward + backward of a packed batch (``tests.test_hf_packed._batch``; documents
    given in ``form``, see ``tests.hf_cases.packed_kwargs``): gathered logits ``(B, S, V)``, the
    loss,
    ``causal_lm_loss``'s, this rank's gradients and whether a cache came back."""
    model = hf.patch_model(
        build(family, seed), sp=ctx.world, group=ctx.group, layout=layout, keep_logits=True
    ).train()
    kw = packed_kwargs(ctx, batch, form, layout, "full")
    by = (
        dict(cu_seqlens=batch["cu"])
        if form == "flash"
        else dict(position_ids=batch["position_ids"])
    )
    out = model(batch["ids"], labels=batch["labels"], use_cache=False, **kw)
    helper = hf.causal_lm_loss(out.logits, batch["labels"], layout=layout, group=ctx.group, **by)
    out.loss.backward()
    logits = hf.gather_logits(out.logits, layout, ctx.group, **by).view(*batch["ids"].shape, -1)
    return dict(
        logits=logits,
        loss=out.loss.item(),
        helper=helper.item(),
        grads=_grads(model),
        cached=out.get("cache") is not None,
    )


def padded_generate(ctx, family, seed, ids, mask, layout, new_tokens):
    """Greedy generate of a left-padded batch (``mask`` with zeros; or of ones: rows of equal
    length, the ordinary decode path) on the patched model: tokens, per-step scores, the batch
    row and position of every token this rank's sharded cache holds, and each layer's cached
    width."""
    model = hf.patch_model(build(family, seed), group=ctx.group, layout=layout)
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
    widths = [
        (layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3]) for layer in cache.layers
    ]
    pos = cache.positions.tolist()
    if (
        cache.rows is None
    ):  # no padding (generate drops a mask of ones): every row holds the same positions
        rows = [r for r in range(ids.shape[0]) for _ in pos]
        return dict(
            tokens=out.sequences,
            scores=torch.stack(out.scores, 1),
            rows=rows,
            positions=pos * ids.shape[0],
            widths=widths,
        )
    return dict(
        tokens=out.sequences,
        scores=torch.stack(out.scores, 1),
        rows=cache.rows.tolist(),
        positions=pos,
        widths=widths,
    )


def compile_train(ctx, family, seed, batches, layout, backend="aot_eager"):
    """The same patched model eager and under ``torch.compile(model, backend=...)`` for each batch
    (same shape, new data; a recompile after the first raises): loss and this rank's gradients of
    both, the compiled frame count after each step and the reasons of the graph breaks."""
    import torch._dynamo

    torch._dynamo.reset()
    model = hf.patch_model(build(family, seed), group=ctx.group, layout=layout).train()
    return compiled_steps(model, batches, backend)


def compiled_steps(model, batches, backend="aot_eager") -> dict:
    """``model`` (patched) eager and compiled for each batch: see ``compile_train``."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    counters.clear()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)

    def step(m, ids):
        model.zero_grad(set_to_none=True)
        out = m(ids, labels=ids, use_cache=False)
        out.loss.backward()
        return dict(loss=out.loss.item(), grads={n: g.clone() for n, g in _grads(model).items()})

    steps, frames = [], []
    try:
        for i, ids in enumerate(batches):
            eager = step(model, ids)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                steps.append(dict(eager=eager, compiled=step(compiled, ids)))
            frames.append(counter.frame_count)
        breaks = sorted({k.splitlines()[0] for k in counters["graph_break"]})
    finally:
        torch._dynamo.reset()
    return dict(steps=steps, frames=frames, breaks=breaks)
