"""ringkv.patch_model with packed documents and right-padding masks (issue #24), on tiny random
Llama / Qwen2 / Mistral, against the unpatched model run document by document (packed) or with
the same mask (padding); and the errors for masks with holes, left padding and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

import ringkv
from ringkv import hf
from tests.hf_cases import build

ARCHS = ("llama", "qwen2", "mistral")
FORMS = ("position_ids", "flash", "seq_idx", "all")
_TOL = dict(atol=5e-5, rtol=1e-4)
WORLD_SETTINGS = dict(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _batch(rows, seed, vocab=128):
    """A packed batch as DataCollatorWithFlattening makes it, with ``rows[r]`` the document
    lengths of row ``r`` (equal sums): ids, labels (-100 at each document's first token),
    position_ids restarting at 0, seq_idx (documents numbered over the batch), the flattened
    cu_seqlens and the longest document."""
    b, s = len(rows), sum(rows[0])
    assert all(sum(r) == s for r in rows), rows
    ids = torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    labels, pos = ids.clone(), torch.zeros(b, s, dtype=torch.long)
    seq_idx, cu, doc = torch.zeros(b, s, dtype=torch.int32), [0], 0
    for r, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            labels[r, start] = -100
            pos[r, start : start + n] = torch.arange(n)
            seq_idx[r, start : start + n] = doc
            start, doc = start + n, doc + 1
            cu.append(cu[-1] + n)
    return dict(
        ids=ids,
        labels=labels,
        position_ids=pos,
        seq_idx=seq_idx,
        cu=cu,
        max_length=max(map(max, rows)),
        docs=[list(r) for r in rows],
    )


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _per_document_reference(arch, seed, batch, config=None, model=None):
    """The unpatched model (``model``, else ``build(arch, seed, **config)``) on each document alone:
    logits (B, S, V) in the batch's arrangement, the loss combined as the packed mean combines it
    (sum of token losses / counted tokens), grads."""
    model = model if model is not None else build(arch, seed, **(config or {}))
    rows, loss_sum, count = [], 0.0, 0
    for r, lengths in enumerate(batch["docs"]):
        start, parts = 0, []
        for n in lengths:
            logits = model(
                batch["ids"][r : r + 1, start : start + n], use_cache=False
            ).logits  # (1, n, V)
            target = batch["labels"][
                r, start + 1 : start + n
            ]  # inside the document; its last token predicts
            loss_sum = loss_sum + F.cross_entropy(
                logits[0, :-1], target, ignore_index=-100, reduction="sum"
            )
            count += int((target != -100).sum())  # the next document's first label: -100
            parts.append(logits)
            start += n
        rows.append(torch.cat(parts, 1))
    loss = loss_sum / count
    loss.backward()
    return torch.cat(rows, 0).detach(), loss.item(), _grads(model)


def _assert_matches(res, logits, loss, grads, real=None):
    for r, got in enumerate(res):
        g, w = (got["logits"], logits) if real is None else (got["logits"][real], logits[real])
        torch.testing.assert_close(g, w, **_TOL, msg=lambda m: f"logits rank {r}: {m}")
        assert got["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), (r, got["loss"], loss)
        if "helper" in got:
            assert got["helper"] == pytest.approx(loss, rel=1e-5, abs=1e-6), (
                r,
                got["helper"],
                loss,
            )
        assert not got["cached"], "a packed or padded forward keeps no KV cache"
    assert set(res[0]["grads"]) == set(grads)
    for name, want in grads.items():  # gradients summed over the SP group, as an all-reduce would
        total = sum(r["grads"][name] for r in res)
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(
            total, want, atol=2e-5 * scale, rtol=1e-4, msg=lambda m: f"grad {name}: {m}"
        )


def _check_packed(
    world,
    arch,
    sp,
    layout,
    inputs,
    form,
    rows,
    seed=0,
    config=None,
    checkpointing=False,
    extra=None,
):
    batch = _batch(rows, seed)
    want = _per_document_reference(arch, seed, batch, config)
    res = world.check(
        "tests.hf_cases:packed_train_step",
        sp,
        arch,
        seed,
        batch,
        layout,
        inputs,
        form,
        config,
        checkpointing,
        extra,
    )
    _assert_matches(res, *want)
    return res


# ---- packed documents against the unpatched model, document by document ----

LENGTHS = st.sampled_from([1, 1, 2, 3, 5, 7, 11, 13]) | st.integers(1, 16)


@st.composite
def packed_case(draw):
    sp = draw(st.integers(1, 4))
    short = st.integers(1, max(sp - 1, 1))  # shorter than the world
    first = draw(st.lists(LENGTHS | short, min_size=1, max_size=5))
    rows, s = [first], sum(first)
    for _ in range(
        draw(st.sampled_from([0, 0, 1]))
    ):  # B > 1: the other rows cut to the same length
        row = []
        for n in draw(st.lists(LENGTHS | short, min_size=1, max_size=6)):
            if sum(row) + n >= s:
                break
            row.append(n)
        rows.append(row + [s - sum(row)])
    assume(any(n > 1 for r in rows for n in r))  # at least one counted label
    return dict(
        arch=draw(st.sampled_from(ARCHS)),
        sp=sp,
        layout=draw(st.sampled_from(ringkv.LAYOUTS)),
        inputs=draw(st.sampled_from(["full", "shard"])),
        form=draw(st.sampled_from(FORMS)),
        rows=rows,
        seed=draw(st.integers(0, 1000)),
    )


@settings(max_examples=12, **WORLD_SETTINGS)
@given(case=packed_case())
# one document per row, given as DataCollatorWithFlattening gives it (form "all"): the model packs
# the
# rows into one, and the helpers told only position_ids must see that (drawn once in CI, then
# failing)
@example(
    case=dict(
        arch="llama", sp=1, layout="contiguous", inputs="full", form="all", rows=[[2], [2]], seed=0
    )
)
@example(
    case=dict(
        arch="llama", sp=2, layout="zigzag", inputs="full", form="all", rows=[[3], [3], [3]], seed=1
    )
)
def test_packed_documents_match_the_unpatched_model_per_document(world, case):
    _check_packed(
        world,
        case["arch"],
        case["sp"],
        case["layout"],
        case["inputs"],
        case["form"],
        case["rows"],
        case["seed"],
    )


@pytest.mark.parametrize(
    "arch,sp,layout,inputs,form,rows",
    [
        ("llama", 4, "zigzag", "full", "position_ids", [[1, 3, 13, 2]]),  # 1 token, < world, prime
        (
            "qwen2",
            3,
            "striped",
            "shard",
            "flash",
            [[7, 1, 5], [2, 11]],
        ),  # B = 2, tied embeddings, biases
        ("mistral", 2, "contiguous", "full", "seq_idx", [[4, 4], [1, 6, 1]]),
        ("llama", 3, "zigzag", "shard", "all", [[1, 1, 9, 2]]),
        ("qwen2", 4, "zigzag", "full", "all", [[3, 2], [5], [1, 1, 1, 2]]),  # B = 3
    ],
)
def test_packed_fixed_cases(world, arch, sp, layout, inputs, form, rows):
    res = _check_packed(world, arch, sp, layout, inputs, form, rows)
    # the varlen layout: every document padded to the granule on its own and split over the ranks
    granule = ringkv.sp.layout.granule(layout, sp)
    assert res[0]["local_rows"] == sum(-(-n // granule) * granule for r in rows for n in r) // sp


@pytest.mark.parametrize(
    "arch,config,rows",
    [
        ("mistral", dict(sliding_window=3), [[9, 2, 6]]),  # window shorter than the documents
        (
            "qwen2",
            dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
            [[10, 1], [3, 8]],
        ),
    ],
)
def test_packed_documents_with_sliding_windows(world, arch, config, rows):
    _check_packed(world, arch, 3, "zigzag", "full", "position_ids", rows, config=config)


def test_packed_documents_with_activation_checkpointing(world):
    _check_packed(world, "llama", 2, "zigzag", "full", "flash", [[5, 1, 8]], checkpointing=True)


def test_the_forms_give_equal_results(world):
    """position_ids, the flash-attn kwargs, seq_idx and all of them together: the same numbers."""
    batch = _batch([[3, 6, 1, 4]], 5)
    for inputs in ("full", "shard"):
        res = [
            world.check(
                "tests.hf_cases:packed_train_step", 3, "llama", 0, batch, "zigzag", inputs, form
            )
            for form in FORMS
        ]
        for other in res[1:]:
            for mine, theirs in zip(res[0], other):
                assert (
                    torch.equal(mine["logits"], theirs["logits"]) and mine["loss"] == theirs["loss"]
                )
                assert all(torch.equal(mine["grads"][n], theirs["grads"][n]) for n in mine["grads"])


# ---- right padding ----


def _padded(lengths, s, seed):
    """Right-padded rows of real lengths ``lengths``: ids (pad 0), mask, labels -100 at the pads."""
    ids = torch.randint(3, 128, (len(lengths), s), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize(
    "arch,sp,layout,inputs,lengths,s",
    [
        (
            "llama",
            4,
            "zigzag",
            "full",
            [13, 5, 1],
            13,
        ),  # one row unpadded, one with a single real token
        ("qwen2", 3, "striped", "full", [7, 2], 10),
        ("mistral", 2, "contiguous", "shard", [12, 3, 9], 12),
        ("llama", 3, "zigzag", "shard", [4, 12], 12),
    ],
)
def test_right_padding_matches_the_unpatched_model_with_the_mask(
    world, arch, sp, layout, inputs, lengths, s
):
    ids, mask, labels = _padded(lengths, s, s)
    model = build(arch, 0)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    res = world.check(
        "tests.hf_cases:padded_train_step", sp, arch, 0, ids, mask, labels, layout, inputs
    )
    _assert_matches(res, out.logits.detach(), out.loss.item(), _grads(model), real=mask.bool())


def test_packed_rows_with_right_padding(world):
    """B = 2 packed rows, row 0 padded at the end (the pads are 1-token documents: position_ids
    0)."""
    batch = _batch([[4, 6, 1, 1, 1], [9, 1, 3]], 2)
    mask = torch.ones_like(batch["ids"])
    mask[0, 10:] = 0
    batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    want = _per_document_reference("qwen2", 0, batch)
    res = world.check(
        "tests.hf_cases:padded_train_step",
        3,
        "qwen2",
        0,
        batch["ids"],
        mask,
        batch["labels"],
        "zigzag",
        "full",
        None,
        dict(position_ids=batch["position_ids"]),
    )
    _assert_matches(res, *want, real=mask.bool())


def test_left_padding_with_position_ids_that_make_each_pad_a_document(world):
    """generate's rule (position_ids = cumsum(mask) - 1, pads 0) makes every left pad a 1-token
    document: the mask's zeros then end their documents, and the real tokens are exact."""
    ids, mask, labels = _padded([9, 4], 9, 1)
    ids, mask, labels = (x.flip(1) for x in (ids, mask, labels))  # left padding
    labels[1, 5] = -100  # after a pad: predicted by it
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0)
    model = build("mistral", 0)
    out = model(ids, attention_mask=mask, position_ids=pos, labels=labels)
    out.loss.backward()
    res = world.check(
        "tests.hf_cases:padded_train_step",
        2,
        "mistral",
        0,
        ids,
        mask,
        labels,
        "zigzag",
        "full",
        None,
        dict(position_ids=pos),
    )
    _assert_matches(res, out.logits.detach(), out.loss.item(), _grads(model), real=mask.bool())


# ---- errors: every rank raises the rule's ValueError ----


def _errors(
    world, sp, kwargs, inputs="full", layout="zigzag", method="ring", arch="llama", config=None
):
    res = world.check(
        "tests.hf_cases:forward_error", sp, arch, 0, layout, inputs, kwargs, method, False, config
    )
    return [kind for kind, _ in res], [m for _, m in res]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])), "hole"),
        (dict(attention_mask=torch.tensor([[1] * 8, [1, 0, 0, 1, 1, 1, 1, 0]])), "hole"),
        (dict(attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])), "left padding"),
        (
            dict(
                attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]),
                position_ids=torch.tensor([[1, 1, 0, 1, 2, 3, 4, 5]]),
            ),
            "left padding",
        ),  # the mask's error, not the position rule's
        (
            dict(
                attention_mask=torch.tensor([[1] * 5 + [0] * 3]), labels=torch.arange(8)[None] + 3
            ),
            "-100 after every padded",
        ),
        (
            dict(position_ids=torch.tensor([[0, 1, 3, 4, 0, 1, 2, 3]])),
            "restart at 0 for each packed document",
        ),
        (dict(position_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])), "restart at 0"),
        (dict(position_ids=torch.tensor([[0, 1, 2, 2, 3, 0, 1, 2]])), "increase by 1"),
        (
            dict(cu_seq_lens_q=torch.tensor([0, 3, 7], dtype=torch.int32)),
            "must end at the number of tokens",
        ),
        (dict(cu_seq_lens_q=torch.tensor([0, 3, 3, 8], dtype=torch.int32)), "strictly increasing"),
        (dict(cu_seq_lens_q=[1, 8]), "start at 0"),
        (dict(cu_seq_lens_q=torch.tensor([0.0, 8.0])), "integer"),
        (
            dict(labels=torch.ones(1, 7, dtype=torch.long)),
            "labels must have the shape of the inputs",
        ),
        (
            dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), cu_seq_lens_q=[0, 4, 8]),
            "different packed documents",
        ),
        (dict(cu_seq_lens_q=[0, 4, 8], cu_seq_lens_k=[0, 3, 8]), "different packed documents"),
        (
            dict(
                seq_idx=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]),
                position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
            ),
            "different packed documents",
        ),
        (
            dict(cu_seq_lens_q=[0, 4, 8], max_length_q=5),
            "max_length_q=5 but the longest packed document has 4",
        ),
        (dict(seq_idx=torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]])), "never decreasing"),
        (dict(cu_seq_lens_q=[0, 4, 8], use_cache=True), "use_cache=False"),
        (dict(cu_seq_lens_q=[0, 4, 8], logits_to_keep=1), "logits_to_keep"),
        (dict(max_length_q=8), "pass cu_seq_lens_q"),
    ],
)
def test_bad_input_is_a_value_error_on_every_rank(world, kwargs, match):
    ids = torch.randint(
        3,
        128,
        (2 if kwargs.get("attention_mask", torch.ones(1)).shape[0] == 2 else 1, 8),
        generator=torch.Generator().manual_seed(0),
    )
    kinds, messages = _errors(world, 3, dict(kwargs, input_ids=ids))
    assert kinds in (["ValueError"] * 3, ["TypeError"] * 3), (kinds, messages)
    assert all(match in m for m in messages), messages


def test_a_document_may_not_cross_batch_rows(world):
    ids = torch.randint(3, 128, (2, 6))
    kinds, messages = _errors(world, 2, dict(input_ids=ids, cu_seq_lens_q=[0, 4, 12]))
    assert kinds == ["ValueError"] * 2 and all(
        "across batch rows 0 and 1" in m for m in messages
    ), messages


def test_auto_runs_packed_documents_on_the_ring(world):
    """``method="auto"`` that chose Ulysses (SmolLM2's heads, 4 ranks, 64 tokens: see test_hf's
    auto test) shards like the ring, so packed documents run the varlen ring, exactly."""
    config = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    extra = dict(method="auto", seq_len=64)
    res = _check_packed(
        world, "llama", 4, "zigzag", "full", "flash", [[5, 3], [8]], config=config, extra=extra
    )
    assert [r["attention"] for r in res] == ["ulysses"] * 4


def test_packing_needs_the_ring(world):
    ids = torch.randint(3, 128, (1, 8))
    kinds, messages = _errors(
        world, 2, dict(input_ids=ids, cu_seq_lens_q=[0, 5, 8]), method="ulysses"
    )
    assert kinds == ["ValueError"] * 2 and all("method='ring'" in m for m in messages), messages


def test_shard_inputs_bad_packed_input(world):
    """inputs="shard": the rules checked on the shards; a rank whose own shard breaks a rule raises
    its error and the others raise too (they are told), instead of waiting for it."""
    cu = [0, 5, 8]  # zigzag over 2 ranks: documents padded to 8 + 4 -> 6 rows per rank
    ids = torch.randint(3, 128, (1, 8))
    shards = [ringkv.shard(ids, 1, "zigzag", rank=r, world=2, cu_seqlens=cu) for r in range(2)]
    per_rank = [dict(input_ids=s) for s in shards]
    kinds, messages = _errors(
        world, 2, dict(per_rank=per_rank, cu_seq_lens_q=[0, 5, 5, 8]), inputs="shard"
    )
    assert kinds == ["ValueError"] * 2 and all("strictly increasing" in m for m in messages), (
        messages
    )
    for bad in ([0, 5, 13], [0, 8]):  # rows of another length: 10 and 4 local rows, not 6
        kinds, messages = _errors(
            world, 2, dict(per_rank=per_rank, cu_seq_lens_q=bad), inputs="shard"
        )
        assert kinds == ["ValueError"] * 2, messages
        assert all("ringkv.shard(ids, 1, layout, group, cu_seqlens" in m for m in messages), (
            messages
        )
    kinds, messages = _errors(
        world,
        2,
        dict(per_rank=[dict(input_ids=torch.ones(2, 6, dtype=torch.long))] * 2, cu_seq_lens_q=cu),
        inputs="shard",
    )
    assert kinds == ["ValueError"] * 2 and all("one packed row" in m for m in messages), messages
    # only rank 1's position_ids are wrong
    good = [ringkv.positions(8, "zigzag", r, 2, cu_seqlens=cu).unsqueeze(0) for r in range(2)]
    per_rank = [
        dict(input_ids=shards[0], position_ids=good[0]),
        dict(input_ids=shards[1], position_ids=good[0]),
    ]
    kinds, messages = _errors(world, 2, dict(per_rank=per_rank, cu_seq_lens_q=cu), inputs="shard")
    assert kinds == ["ValueError"] * 2, messages
    assert "positions within their documents" in messages[1] and "input checks" in messages[0], (
        messages
    )
    # a shard-mode mask with a hole in the global row (each rank's own part looks fine): gathered,
    # then raised
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 3] = 0  # the end of rank 0's contiguous shard
    per_rank = [
        dict(
            input_ids=ringkv.shard(ids, 1, "contiguous", rank=r, world=2),
            attention_mask=ringkv.shard(mask, 1, "contiguous", rank=r, world=2),
        )
        for r in range(2)
    ]
    kinds, messages = _errors(
        world, 2, dict(per_rank=per_rank), inputs="shard", layout="contiguous"
    )
    assert kinds == ["ValueError"] * 2 and all("hole" in m for m in messages), messages


def test_bad_input_raises_before_any_collective(world):
    """Only rank 0 calls (with bad input): it must raise at once, not wait for its peers."""
    ids = torch.randint(3, 128, (1, 8))
    for kw in (
        dict(position_ids=torch.tensor([[0, 1, 3, 4, 5, 6, 7, 8]])),
        dict(cu_seq_lens_q=[0, 3, 7]),
        dict(attention_mask=torch.tensor([[1, 0] * 4])),
    ):
        res = world.check(
            "tests.hf_cases:forward_error",
            2,
            "llama",
            0,
            "zigzag",
            "full",
            dict(kw, input_ids=ids),
            "ring",
            True,
        )
        assert res[0][0] == "ValueError" and res[1][0] == "skipped", res


def test_helpers_single_process():
    """packed_cu_seqlens, gather_logits and causal_lm_loss on one rank (no process group)."""
    batch = _batch([[2, 3], [4, 1]], 0)
    assert (
        hf.packed_cu_seqlens(position_ids=batch["position_ids"]) == [0, 2, 5, 9, 10] == batch["cu"]
    )
    assert (
        hf.packed_cu_seqlens(seq_idx=batch["seq_idx"], cu_seq_lens_q=torch.tensor(batch["cu"]))
        == batch["cu"]
    )
    assert hf.packed_cu_seqlens(position_ids=torch.arange(4).expand(2, 4)) == [0, 4, 8]
    with pytest.raises(ValueError, match="different packed documents"):
        hf.packed_cu_seqlens(position_ids=batch["position_ids"], cu_seq_lens_q=[0, 5, 10])
    with pytest.raises(ValueError, match="sharded packed labels need cu_seqlens"):
        hf.causal_lm_loss(
            torch.zeros(1, 8, 4),
            torch.zeros(1, 8, dtype=torch.long),
            sharded=True,
            position_ids=batch["position_ids"],
        )
    logits = torch.randn(1, 10 * 2, 7)  # zigzag on one rank: documents padded to 2, 4, 4, 2
    with pytest.raises(ValueError, match=r"shards of shape \(1, 12, V\)"):
        hf.causal_lm_loss(logits, batch["labels"], position_ids=batch["position_ids"])
