"""World cases for tests/test_hf_encoders.py: ``ringkv.patch_model`` on tiny random encoders
(ModernBERT with a local window of +-4 tokens on layer 1, BERT, RoBERTa, XLM-R) and a Llama run
bidirectionally (``is_causal=False``), on every rank of the case's group.

Models are built from ``(family, head, seed)`` in every process (the same weights everywhere);
the test process builds the same model unpatched as the reference (``reference``). Every head of a
family runs in one case: masked-LM and token classification loss and logits, sequence
classification loss and logits, pooled embeddings (``pooling=``) and every gradient.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ringkv import hf  # noqa: E402

VOCAB = 100
# (head, pooling): "mlm" *ForMaskedLM, "tok" *ForTokenClassification, "cls:<pooling>"
# *ForSequenceClassification, "base:<pooling>" the base model with pooling=
HEADS = {
    "modernbert": ("mlm", "tok", "cls:cls", "cls:mean", "base:mean"),
    "bert": ("mlm", "tok", "cls:cls", "base:cls"),
    "roberta": ("mlm", "cls:cls"),
    "xlm_roberta": ("mlm", "cls:cls"),
    "llama": ("base:mean", "base:last"),
}


def config(family: str, pooling: str = "cls"):
    """A tiny config (hidden 32, 2 layers, 2 heads, vocab 100, 3 labels, no dropout)."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_labels=3,
    )
    if family == "modernbert":  # layer 0 global, layer 1 local: +-4 tokens
        return transformers.ModernBertConfig(
            **common,
            local_attention=8,
            global_attn_every_n_layers=2,
            max_position_embeddings=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            attention_dropout=0.0,
            embedding_dropout=0.0,
            mlp_dropout=0.0,
            classifier_dropout=0.0,
            classifier_pooling=pooling,
        )
    if family == "llama":  # an embedding model: a decoder run bidirectionally
        return transformers.LlamaConfig(
            **common, num_key_value_heads=1, max_position_embeddings=128, is_causal=False
        )
    cls = dict(
        bert=transformers.BertConfig,
        roberta=transformers.RobertaConfig,
        xlm_roberta=transformers.XLMRobertaConfig,
    )[family]
    pad = 0 if family == "bert" else 1  # RoBERTa's positions start after the pad id
    return cls(
        **common,
        max_position_embeddings=128 + pad + 1,
        pad_token_id=pad,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        type_vocab_size=2,
    )


def build(family: str, head: str, seed: int):
    """The tiny fp32 model of ``family`` with ``head`` (``"mlm"``, ``"tok"``, ``"cls:<pooling>"``,
    ``"base:<pooling>"``), eval mode, the same for a seed in every process."""
    import transformers

    kind, _, pooling = head.partition(":")
    torch.manual_seed(seed)
    c = config(family, pooling if kind == "cls" else "cls")
    auto = dict(
        mlm=transformers.AutoModelForMaskedLM,
        tok=transformers.AutoModelForTokenClassification,
        cls=transformers.AutoModelForSequenceClassification,
        base=transformers.AutoModel,
    )[kind]
    model = auto.from_config(c, dtype=torch.float32, attn_implementation="eager")
    if family == "llama":
        for m in model.modules():
            if hasattr(m, "is_causal"):
                m.is_causal = False
    return model.eval()


def batch(family: str, b: int, s: int, lengths, seed: int) -> dict:
    """Right-padded rows (``lengths`` real tokens each; pads = the pad id), MLM labels on about a
    third of the real tokens (-100 elsewhere), class labels ``(B,)``, token types and a fixed
    probe ``(B, H)`` that the pooled outputs are dotted with."""
    g = torch.Generator().manual_seed(seed)
    pad = 1 if family in ("roberta", "xlm_roberta") else 0
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.where(mask.bool(), ids, pad)
    picked = (torch.rand(b, s, generator=g) < 0.35) & mask.bool()
    picked[:, 0] = True
    labels = torch.where(picked, ids, -100)
    types = (torch.arange(s)[None] >= s // 2).long().expand(b, s) * mask
    return dict(
        ids=ids,
        mask=mask,
        labels=labels,
        classes=torch.randint(0, 3, (b,), generator=g),
        types=types if family in ("bert", "roberta", "xlm_roberta") else None,
        probe=torch.randn(b, 32, generator=g),
    )


def _forward(model, head: str, data: dict):
    """One forward and its scalar training loss: ``(out, loss, kind)``."""
    kind, _, pooling = head.partition(":")
    kw = dict(attention_mask=data["mask"])
    if data["types"] is not None:
        kw["token_type_ids"] = data["types"]
    if kind in ("mlm", "tok"):  # per-token labels: MLM targets, or token classes
        labels = (
            data["labels"]
            if kind == "mlm"
            else torch.where(data["labels"] >= 0, data["labels"] % 3, -100)
        )
        out = model(data["ids"], labels=labels, **kw)
        return out, out.loss
    if kind == "cls":
        out = model(data["ids"], labels=data["classes"], **kw)
        return out, out.loss
    return out_pooled(model, data, pooling, kw)


def out_pooled(model, data, pooling, kw):
    if getattr(model, "_ringkv_state", None) is None:
        out = model(data["ids"], **kw)
        out.pooled = pool_reference(out.last_hidden_state, data["mask"], pooling)
    else:
        out = model(data["ids"], pooling=pooling, **kw)
    return out, (out.pooled * data["probe"]).sum()


def pool_reference(h, mask, how):
    """Pooling of whole rows ``h`` ``(B, S, H)`` by ``mask``, as sentence-transformers does."""
    m = mask.to(h.dtype)
    if how == "mean":
        return (h * m[..., None]).sum(1) / m.sum(1, keepdim=True)
    if how == "cls":
        return h[:, 0]
    last = mask.sum(1) - 1
    return h[torch.arange(h.shape[0]), last]


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _result(out, loss, model, head, data, gathered=None) -> dict:
    kind = head.partition(":")[0]
    logits = None
    if kind in ("mlm", "tok"):
        logits = out.logits.detach() if gathered is None else gathered(out.logits.detach())
    elif kind == "cls":
        logits = out.logits.detach()
    pooled = out.pooled.detach() if kind == "base" else None
    return dict(loss=loss.item(), logits=logits, pooled=pooled, grads=_grads(model))


def reference(family: str, seed: int, data: dict) -> dict:
    """The unpatched model of every head of ``family``: ``{head: result}``."""
    res = {}
    for head in HEADS[family]:
        model = build(family, head, seed).train()
        out, loss = _forward(model, head, data)
        loss.backward()
        res[head] = _result(out, loss, model, head, data)
    return res


def encoder_step(ctx, family, seed, data, layout, method="ring", checkpointing=False):
    """Every head of ``family`` patched over the case's group (``checkpointing``: with HF
    activation checkpointing): loss, logits (MLM: gathered into ``(B, S, V)``), pooled outputs and
    this rank's gradients, ``{head: result}``."""
    cu = hf.encoder_cu_seqlens(data["mask"], layout=layout, group=ctx.group)
    group = None if method == "usp" else ctx.group  # USP: sp_groups of the whole world
    u = 1

    def gathered(local):
        b, s = data["ids"].shape
        if cu is None:
            return hf.gather_logits(local, layout, group, seq_len=s, ulysses=u)
        return hf.gather_logits(local, layout, group, cu_seqlens=cu).view(b, s, -1)

    res = {}
    for head in HEADS[family]:
        model = build(family, head, seed)
        hf.patch_model(model, group=group, layout=layout, method=method).train()
        u = hf.describe(model)["shard_ulysses"]
        if checkpointing:
            model.gradient_checkpointing_enable()
        out, loss = _forward(model, head, data)
        loss.backward()
        res[head] = _result(out, loss, model, head, data, gathered)
    return res
