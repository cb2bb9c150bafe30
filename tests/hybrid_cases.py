"""World cases for tests/test_hf_hybrid.py: ``ringkv.patch_model`` on tiny random hybrid models of
every family ringkv splits (Qwen3-Next, Qwen3.5, Falcon-H1, Bamba, Nemotron-H, Granite 4 hybrid,
LFM2, Jamba, Zamba2, Kimi Linear), run on every rank of the case's group.

Models are built from ``(family, seed)`` in every process (the same weights everywhere); the test
process builds the same model unpatched as the reference. Each has a few layers mixing attention
with the family's recurrent kind (short convolution, Mamba2 SSD, Mamba selective scan, gated delta
rule, KDA), fp32, hidden 64, vocab 128; chunked scans use chunks of 4 tokens (so a rank's piece
spans several); MoE routers pick every expert (routing stays smooth under SP rounding).
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ringkv import hf  # noqa: E402
from tests.hf_cases import packed_kwargs  # noqa: E402

FAMILIES = (
    "qwen3_next",
    "qwen3_5",
    "falcon_h1",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "lfm2",
    "jamba",
    "zamba2",
    "kimi_linear",
)
# families whose modeling modules carry the same mixers and functions as one above
MORE = ("qwen3_5_moe", "lara_mini", "olmo_hybrid", "lfm2_moe", "lfm3", "bailing_hybrid")

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4)


# KDA beside MLA, MoE MLPs (Kimi Linear, Bailing-hybrid)
_KDA_MLA = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_key_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_local_experts=2,
    num_experts_per_tok=2,
    n_shared_experts=1,
)


def _gdn(layers):
    return dict(
        intermediate_size=96,
        num_hidden_layers=len(layers),
        layer_types=layers,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )


def _configs():
    """family -> (config class name, its arguments besides ``_COMMON``)."""
    lin, full = "linear_attention", "full_attention"
    gdn_moe = dict(
        _gdn([lin, full, lin]),
        num_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    conv = dict(
        intermediate_size=96,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3,
    )
    return {
        "qwen3_next": ("Qwen3NextConfig", dict(gdn_moe, decoder_sparse_step=1)),
        "qwen3_5": ("Qwen3_5TextConfig", _gdn([lin, lin, full])),
        "falcon_h1": (  # attention and Mamba2 side by side in every layer
            "FalconH1Config",
            dict(
                intermediate_size=96,
                num_hidden_layers=2,
                mamba_d_ssm=64,
                mamba_chunk_size=4,
                mamba_expand=1,
                **_MAMBA2,
            ),
        ),
        "bamba": (
            "BambaConfig",
            dict(
                intermediate_size=96,
                num_hidden_layers=3,
                attn_layer_indices=[1],
                mamba_expand=1,
                mamba_chunk_size=4,
                **_MAMBA2,
            ),
        ),
        "nemotron_h": (
            "NemotronHConfig",
            dict(
                intermediate_size=96,
                layers_block_type=["mamba", "attention", "mlp", "mamba"],
                head_dim=16,
                ssm_state_size=8,
                mamba_num_heads=4,
                mamba_head_dim=16,
                n_groups=2,
                conv_kernel=4,
                expand=1,
                chunk_size=4,
            ),
        ),
        "granitemoehybrid": (
            "GraniteMoeHybridConfig",
            dict(
                intermediate_size=32,
                num_hidden_layers=3,
                layer_types=["mamba", "attention", "mamba"],
                num_local_experts=2,
                num_experts_per_tok=2,
                shared_intermediate_size=32,
                mamba_expand=1,
                mamba_chunk_size=4,
                **_MAMBA2,
            ),
        ),
        "lfm2": ("Lfm2Config", conv),
        "jamba": (
            "JambaConfig",
            dict(
                intermediate_size=96,
                num_hidden_layers=3,
                attn_layer_period=3,
                attn_layer_offset=1,
                num_experts=2,
                num_experts_per_tok=2,
                expert_layer_period=2,
                expert_layer_offset=1,
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=1,
                mamba_dt_rank=8,
            ),
        ),
        "zamba2": (
            "Zamba2Config",
            dict(
                intermediate_size=96,
                num_hidden_layers=3,
                layers_block_type=["mamba", "hybrid", "mamba"],
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=1,
                mamba_ngroups=2,
                n_mamba_heads=4,
                chunk_size=4,
                num_mem_blocks=1,
                use_mem_rope=True,
            ),
        ),
        "kimi_linear": (
            "KimiLinearConfig",
            dict(_KDA_MLA, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4),
        ),
        # the same mixers in other families' modeling modules
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", gdn_moe),
        "lara_mini": ("LaraMiniConfig", gdn_moe),
        "olmo_hybrid": (
            "OlmoHybridConfig",
            dict(_gdn([lin, full, lin]), linear_allow_neg_eigval=True),
        ),
        "lfm2_moe": (
            "Lfm2MoeConfig",
            dict(
                conv,
                moe_intermediate_size=32,
                num_dense_layers=1,
                num_experts=2,
                num_experts_per_tok=2,
            ),
        ),
        "lfm3": (
            "Lfm3Config",
            dict(conv, head_dim=16),
        ),
        "bailing_hybrid": (
            "BailingHybridConfig",
            dict(
                _KDA_MLA,
                head_dim=16,
                short_conv_kernel_size=4,
                n_group=1,
                topk_group=1,
                num_mtp_layers=0,
            ),
        ),
    }


def config(family: str, **overrides):
    """The tiny transformers config of ``family``."""
    import transformers

    name, kw = _configs()[family]
    args = dict(_COMMON)
    args.update(kw)
    args.update(overrides)
    return getattr(transformers, name)(**args)


def build(family: str, seed: int, **overrides):
    """The tiny fp32 model of ``family`` (eval mode), the same for a seed in every process."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config(family, **overrides), dtype=torch.float32
    )
    return model.eval()


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _patch(ctx, family, seed, layout, **kw):
    return hf.patch_model(build(family, seed), sp=ctx.world, group=ctx.group, layout=layout, **kw)


def train_step(ctx, family, seed, ids, layout, opts=None):
    """A patched training forward (labels, the chunked loss: no logits) and backward, then an eval
    forward of the same ids: the eval logits gathered ``(B, S, V)``, the loss and this rank's
    gradients. ``opts``: ``patch_model`` arguments (``tile_mlp``, ``method``), and
    ``checkpointing=True`` for HF gradient checkpointing."""
    patch_kw = dict(opts or {})
    ckpt = patch_kw.pop("checkpointing", False)
    plant = patch_kw.pop("plant", None)
    model = _patch(ctx, family, seed, layout, **patch_kw).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # a planted bug: the recurrent layers on this rank's rows alone
    with _unwrapped(model) if plant == "local" else contextlib.nullcontext():
        out = model(ids, labels=ids, use_cache=False)
        assert out.logits is None  # the chunked loss
        out.loss.backward()
        model.eval()
        with torch.no_grad():
            logits = model(ids).logits  # (B, S_pad / N, V)
    hf.unpatch_model(model)
    full = hf.gather_logits(logits, layout, ctx.group, seq_len=ids.shape[1])
    return dict(logits=full, loss=out.loss.item(), grads=_grads(model), cached=False)


def _unwrapped(model):
    """A context in which the modeling module's own functions are back under a patched model (its
    recurrent layers then run on each rank's rows alone, as without ringkv's wrappers)."""
    import contextlib
    import importlib

    from ringkv.hf import recurrent

    @contextlib.contextmanager
    def ctx():
        saved = []
        for m, kind in recurrent.classify(model):
            mod = importlib.import_module(type(m).__module__)
            for name in recurrent.WRAPPED[kind]:
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, recurrent.original(type(m).__module__, name))
        try:
            yield
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)

    return ctx()


def shard_step(ctx, family, seed, ids, layout):
    """``inputs="shard"``: every rank passes its own shard of ids and labels."""
    from ringkv.sp.layout import shard

    model = _patch(ctx, family, seed, layout, inputs="shard", keep_logits=True).train()
    local = shard(ids, 1, layout, rank=ctx.rank, world=ctx.world)
    out = model(local, labels=local, use_cache=False)
    out.loss.backward()
    full = hf.gather_logits(out.logits.detach(), layout, ctx.group, seq_len=ids.shape[1])
    return dict(logits=full, loss=out.loss.item(), grads=_grads(model), cached=False)


def packed_train_step(ctx, family, seed, batch, layout):
    """Packed documents as DataCollatorWithFlattening passes them (``position_ids`` restarting at
    0): gathered logits ``(B, S, V)``, the loss and this rank's gradients."""
    model = _patch(ctx, family, seed, layout, keep_logits=True).train()
    kw = packed_kwargs(ctx, batch, "position_ids", layout, "full")
    out = model(batch["ids"], labels=batch["labels"], use_cache=False, **kw)
    out.loss.backward()
    logits = hf.gather_logits(out.logits, layout, ctx.group, position_ids=batch["position_ids"])
    return dict(
        logits=logits.view(*batch["ids"].shape, -1),
        loss=out.loss.item(),
        grads=_grads(model),
        cached=out.get("cache") is not None,
    )


def padded_generate(ctx, family, seed, ids, mask, layout, new_tokens):
    """Greedy generate of a (left-padded) batch on the patched model: tokens and per-step scores,
    and each recurrent layer's cached states (the same on every rank)."""
    model = _patch(ctx, family, seed, layout)
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
    states = [
        [
            t
            for d in (layer.conv_states, layer.recurrent_states)
            for t in d.values()
            if t is not None
        ]
        for layer in cache.layers
        if hasattr(layer, "conv_states")
    ]  # each recurrent layer's conv tails (B, C, K) and recurrent states
    hf.unpatch_model(model)
    return dict(tokens=out.sequences, scores=torch.stack(out.scores, 1), states=states)


def compile_train(ctx, family, seed, batches, layout, backend="aot_eager"):
    """The patched model eager and under ``torch.compile`` (``family_cases.compiled_steps``): loss
    and grads of both per batch, frame counts and graph-break reasons."""
    import torch._dynamo

    from tests.family_cases import compiled_steps

    torch._dynamo.reset()
    return compiled_steps(_patch(ctx, family, seed, layout).train(), batches, backend)


def trainer_step(ctx, family, seed, rows, layout, out_dir):
    """One SGD step (lr 1) of ``sp_trainer(Trainer)`` over ``rows`` ``(n, S)`` on a model patched
    over the whole world (sp = world, dp = 1; accelerate wraps it in DDP over the world as under
    torchrun, from the RANK/WORLD_SIZE this sets): the logged loss and the weights after the
    step."""
    import transformers

    from ringkv.trainer import sp_trainer

    env = dict(
        RANK=str(ctx.rank),
        WORLD_SIZE=str(ctx.world),
        LOCAL_RANK=str(ctx.rank),
        LOCAL_WORLD_SIZE=str(ctx.world),
    )
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        model = _patch(ctx, family, seed, layout).train()
        args = transformers.TrainingArguments(**trainer_args(out_dir, len(rows), ddp=True))
        trainer = sp_trainer(transformers.Trainer)(
            model=model, args=args, train_dataset=[dict(input_ids=r, labels=r) for r in rows]
        )
        out = trainer.train()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return dict(
        loss=out.training_loss, weights={n: p.detach().clone() for n, p in model.named_parameters()}
    )


def trainer_args(out_dir, batch: int, ddp: bool) -> dict:
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        max_grad_norm=0.0,
        weight_decay=0.0,
        ddp_backend="gloo" if ddp else None,
    )


def mismatched_patch(ctx, family, seed, overrides):
    """``patch_model`` where the last rank's model has another config (``overrides``): the error
    every rank raises (type, message), or None."""
    kw = overrides if ctx.rank == ctx.world - 1 else {}
    try:
        hf.patch_model(build(family, seed, **kw), group=ctx.group)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


def dead_in_mixer(ctx, family, seed, ids, timeout_s):
    """Every rank but 0 dies on entering its first recurrent layer (after the step's checks
    agreed); rank 0 runs on into that layer's halo and state passing and must fail within the
    timeout: ``(error type, message, seconds)``."""
    from ringkv.hf import recurrent
    from tests.hf_cases import timed_forward

    model = _patch(ctx, family, seed, "zigzag", timeout=timeout_s)
    if ctx.rank != 0:

        def die(*_):
            raise RuntimeError("this rank died")

        recurrent.classify(model)[0][0].register_forward_pre_hook(die)
    return timed_forward(model, ids)


def engine_model(family: str, seed: int, **overrides):
    """``build``'s model for the engine's tests: no EOS (every request runs to its length) and
    the LM head scaled up, so greedy choices are clear (a parallel engine's summation order must
    not decide a near tie)."""
    model = build(family, seed, eos_token_id=None, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    return model
