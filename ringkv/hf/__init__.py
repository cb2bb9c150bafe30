"""Sequence-parallel (ring) attention for HuggingFace causal LMs and encoders in one call.

    model = ringkv.patch_model(model, group=sp_group, layout="zigzag")   # every rank of the group
    # ids: the FULL sequence on every rank (inputs="full")
    out = model(input_ids=ids)
    logits = out.logits                         # (B, S_pad / N, V): this rank's shard, in `layout`
    full = ringkv.gather_logits(logits, "zigzag", sp_group, seq_len=ids.shape[1])  # (B, S, V)
    loss = ringkv.causal_lm_loss(logits, labels, layout="zigzag", group=sp_group)  # global mean
    # no logits built (keep_logits)
    loss = model.train()(input_ids=ids, labels=ids, use_cache=False).loss
    # per-token log-probs of the labels, no logits built: (B, S_pad / N) shards; per-sequence sums
    out = model(input_ids=ids, labels=labels, per_token=("entropy", "is_top1"))
    logp = ringkv.sequence_sums(out.log_probs, sp_group)                   # (B,) on every rank
    tokens = model.generate(ids, max_new_tokens=32, do_sample=False)   # sharded KV cache

How it works: ``patch_model`` registers the attention function ``"ringkv"`` with transformers'
public ``AttentionInterface`` and switches the model to it with ``set_attn_implementation``.
A forward pre-hook on the model shards the inputs and supplies *global* ``position_ids`` (so
rotary embeddings and causal masks see global positions in every layout); the attention
function runs ``ringkv.ring_attention`` (or ``ulysses_attention`` / ``usp_attention`` with
``method=``; prefill, differentiable) or ``ringkv.sp.decode.decode_attention`` (new tokens over
the sharded cache), with the layer's sliding window when it has one. A forward hook
assembles ``logits_to_keep`` logits and the loss when ``labels`` are passed.

Training (``model.train()``, ``labels`` or ``shift_labels``): the loss comes from the base model's
last hidden states through the head in chunks (``kernels/linear_ce.py``) and ``out.logits`` is
``None``: the ``(B, S/N, V)`` logits are never built (``keep_logits=True`` keeps them). HF's
``num_items_in_batch`` divides it. ``tile_mlp`` and ``offload_checkpoints`` (``ringkv/memory.py``)
take the MLP's and the checkpoints' share of a step down too.

Per-token log-probs (``logprobs.py``; DPO, GRPO, SFT's metrics): a forward with labels (or
``shift_labels``) and ``per_token=True`` (or names among ``"log_probs"``, ``"entropy"``,
``"is_top1"``, ``"mean_logits"``), in training or eval mode, goes through the head in chunks
(``kernels.linear_ce.linear_log_probs``), builds no logits, and adds to the output this rank's
``log_probs``, ``label_mask`` and the fields asked for, each shaped like its targets
``(B, S_pad / N)`` (packed: ``(1, L_local)``), 0 where the target is -100; ``out.loss`` is the
usual global mean, from the same log-probs. ``sequence_sums`` sums such values per sequence (per
packed document) over the SP group; ``per_token_temperature=T`` divides their logits by ``T``
(TRL's GRPO). ``per_token`` without targets, or on a model patched with ``keep_logits=True``, is a
``ValueError``.

Inputs (``inputs=`` of ``patch_model``):

- ``"full"`` (default): every rank passes the whole ``input_ids`` (or ``inputs_embeds``),
  ``(B, S)``. ringkv shards them in ``layout``. When ``S`` is not a multiple of the layout's
  granule (``N`` ranks: ``N`` for contiguous/striped, ``2N`` for zigzag) the sequence is padded
  **at the end** to ``S_pad`` (pad token ``config.pad_token_id`` or 0). Causal attention never
  lets a real token see a later one, so real tokens are exact; the padded rows appear in the
  local logits (``gather_logits(..., seq_len=S)`` drops them, ``causal_lm_loss`` ignores them)
  and are never stored in the KV cache.
- ``"shard"``: every rank passes its own shard ``(B, S/N)`` in ``layout`` (e.g. from
  ``ringkv.shard``), optionally with ``position_ids`` that must be the shard's global
  positions (``ringkv.positions(S, layout, rank, N)``); ringkv computes them when omitted.
  No padding is added: ``S`` must be a multiple of the granule.

Packed documents (training and scoring, ``method="ring"``): ``position_ids`` that restart at 0
for each document (``DataCollatorWithFlattening``), and/or ``cu_seq_lens_q``/``cu_seq_lens_k``
with ``max_length_q``/``max_length_k``, and/or ``seq_idx`` (checked against each other). Each
document attends only within itself: the batch rows are flattened into one packed row
(``cu = packed_cu_seqlens(...)``, over ``B * S`` tokens), sharded with ``shard(...,
cu_seqlens=cu)`` (every document split by the layout and padded on its own) and run through the
varlen ring; ``out.logits`` is this rank's ``(1, L_local, V)``; ``gather_logits`` and
``causal_lm_loss`` take the same ``position_ids`` / ``seq_idx`` / ``cu_seqlens``. With
``inputs="shard"`` pass the shard of the packed row and the whole row's ``cu_seq_lens_q``.
Padding: zeros at the end of a row (or of a packed document) in ``attention_mask`` are honoured
by ignoring them (causal attention never lets a real token see a later pad); the targets of
padded tokens must be -100. Other zeros (holes, left padding) are a ``ValueError`` (left padding
with a KV cache is batched generation: below). Packed or right-padded forwards keep no KV cache.

Once a ``ShardedKVCache`` holds tokens, later calls (decode steps) take new tokens that are the
same on every rank (``(B, T)``, any ``T >= 1``) in both modes; they are appended to one owner
rank's cache (round-robin over steps) and every rank gets the same logits.

Left-padded batches (batched ``generate``, ``inputs="full"``, ``method="ring"``): with a KV cache,
an ``attention_mask`` whose rows are zeros then ones and ``position_ids = mask.cumsum(-1) - 1`` at
the real tokens (what generate passes) run the prefill as the varlen ring over the rows' real tokens
packed one document per row; pads are never computed or cached. The cache then packs every row's
real tokens into one cache row (``cache.rows``: whose each is; ``cache.lengths``: real tokens per
row); a decode step must pass the grown mask (the prompt's, then ones) and each row's next
positions, and attends in one kernel call on virtual positions ``row * 2R + position`` (no key of
another row is visible) with the usual single all-gather merge per layer.

Generation: ``model.generate`` (``inputs="full"``) works as usual on every rank in lockstep;
an empty ``DynamicCache`` (generate's default) is replaced by a :class:`ShardedKVCache` that
keeps only this rank's tokens. Sampling must use the same seed on every rank.

Encoders and bidirectional attention (``encoder.py``; ModernBERT, BERT, RoBERTa, XLM-R: base models,
``*ForMaskedLM``, ``*ForTokenClassification``, ``*ForSequenceClassification``; decoders whose config
and attention layers have ``is_causal=False``: base models): the ring runs non-causal, ModernBERT's
local layers with a two-sided window; right padding (and the layout's end padding) become documents
of their own that no real token sees (the varlen ring; outputs ``(1, L_local, .)``,
``encoder_cu_seqlens`` gives their ``cu_seqlens``); RoBERTa's positions and ``token_type_ids`` are
computed on whole rows and sharded. ``labels`` are each token's target (no shift): the masked-LM
loss is the global mean. ``pooling="mean" | "cls" | "last"`` adds ``out.pooled`` ``(B, H)`` over the
whole rows on every rank (``sp.collectives.shared_pool``); classification heads pool the same way (a
pre-hook gives the pooling module the pooled token) and their parameters' gradients are scaled by
``1 / N`` (they run replicated). ``inputs="full"`` only; no KV cache (no ``generate``).

Not supported (clear errors): padding in ``attention_mask`` other than at the end of rows or
documents (training, scoring) or at the start of rows (with a KV cache: batched generate), a pad
pattern that changes between decode steps, attention dropout, bidirectional models other than the
above, models that do not call attention through ``AttentionInterface``. Soft-capping (Gemma 2's
``softcap``), attention sinks (gpt-oss's ``s_aux``) and a V head size of its own (MLA: DeepSeek-V3,
Kimi-K2) run in every SP method and in decode, exactly.

The package, bottom to top: ``state.py`` (the records), ``packing.py`` (packed documents and
padded rows, checked whole; labels into a rank's targets), ``logprobs.py`` (``per_token``'s
fields, ``sequence_sums``), ``plan.py`` (one forward's inputs, planned), ``loss.py`` (the loss,
``causal_lm_loss``, ``gather_logits``), ``method.py`` (which SP attention runs:
``method="auto"``'s choice, ``describe``), ``encoder.py`` (bidirectional models: refusals,
padding as documents, pooling), ``attention.py`` (the attention function and
``ShardedKVCache``), ``recurrent.py`` (hybrid models' recurrent layers: short convolutions, Mamba2
and Mamba scans, gated DeltaNet and KDA, run by their SP forms from ``ringkv.sp``), ``vlm.py``
(vision-language models: their text decoder's inputs cut to this rank's shard), ``image_mask.py``
(Gemma 3's images, which see all of themselves: ``spans=`` of the SP attention), ``patch.py``
(``patch_model`` and its hooks).

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and MoE), LLaVA-OneVision, Gemma 3;
``vlm.py``): every rank passes the whole inputs, pixels too; the vision tower runs whole on every
rank and the model merges the image features and computes its positions (3-D multimodal RoPE) as
unpatched; a pre-hook on its text decoder (``language_model``) keeps this rank's rows of the merged
``inputs_embeds``, of the positions and of the token masks and features that follow them. Loss,
gradients (the vision tower's: each rank's share), ``gather_logits`` and ``generate`` are as for
text LMs. Gemma 3's images see all of themselves (``image_mask.py``: the runs of
``token_type_ids == 1`` become the attention's ``spans=``). Other VLMs, ``inputs="shard"``, padding
masks and packed documents are refused, naming why.

Hybrid models (Qwen3-Next, Qwen3.5, Falcon-H1, Bamba, Nemotron-H, Granite 4 hybrid, LFM2, Jamba,
Zamba2, Kimi Linear; layouts contiguous and zigzag): the recurrent layers pass their state across
ranks in sequence order and restart it at each packed document; ``generate`` keeps each row's
recurrent state in transformers' cache on every rank. Models with a recurrent, convolution or
state-space layer ringkv does not know are refused at patch time, naming the layer's class.
"""

# ringkv_attention and the constants: the other public names of the single-module ringkv.hf
from .attention import ShardedKVCache, ringkv_attention  # noqa: F401
from .encoder import POOLINGS, encoder_cu_seqlens  # noqa: F401
from .logprobs import PER_TOKEN, sequence_sums  # noqa: F401
from .loss import causal_lm_loss, gather_logits
from .packing import LEFT_PAD_HELP, packed_cu_seqlens  # noqa: F401
from .patch import describe, patch_model, unpatch_model
from .plan import AGREE_NAMES, PACKING_KEYS, PADDING_HELP  # noqa: F401
from .state import ATTN_NAME, IGNORE_INDEX, METHODS  # noqa: F401

__all__ = [
    "patch_model",
    "unpatch_model",
    "describe",
    "gather_logits",
    "causal_lm_loss",
    "sequence_sums",
    "packed_cu_seqlens",
    "encoder_cu_seqlens",
    "ShardedKVCache",
    "ATTN_NAME",
]
