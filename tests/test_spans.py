"""Causal attention with bidirectional spans (Gemma 3's image tokens) across ranks: ring, Ulysses
and USP in every layout against float64 attention with the mask spelled out here, forward (out,
lse) and backward (dq, dk, dv)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import ringkv
from ringkv.sp.layout import chunks
from ringkv.sp.spans import span_calls, spans_of_mask
from tests.checks import assert_close

SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def oracle_mask(spans, b, s, left):
    """(B, S, S) bool: key ``j`` visible to query ``i`` iff ``j <= i``, or both lie in one span;
    and ``j >= i - left`` (a sliding window, ``-1`` none): transformers' Gemma 3 rule
    ``AND(window, OR(causal, same image block))``, token by token."""
    block = torch.full((b, s), -1)
    for row, row_spans in enumerate(spans):
        for n, (start, stop) in enumerate(row_spans):
            block[row, start:stop] = n
    seen = torch.zeros(b, s, s, dtype=torch.bool)
    for row in range(b):
        for i in range(s):
            for j in range(s):
                same = block[row, i] >= 0 and block[row, i] == block[row, j]
                seen[row, i, j] = (j <= i or same) and (left < 0 or j >= i - left)
    return seen


def reference(q, k, v, dout, dlse, mask):
    """float64 attention under ``mask`` (B, S, S): out, lse, dq, dk, dv."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(g, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = s.logsumexp(-1)  # (B, H, S)
    out = torch.einsum("bhqk,bkhd->bqhd", (s - lse[..., None]).exp(), vv)
    loss = (out * dout.double()).sum() + (0 if dlse is None else (lse * dlse.double()).sum())
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@st.composite
def spans_row(draw, s, kind):
    """Spans of one row: none, one, several (adjacent runs merge, as transformers' blocks do)."""
    if kind == "none":
        return []
    mask = torch.zeros(s, dtype=torch.bool)
    for _ in range(1 if kind == "one" else draw(st.integers(2, 4))):
        start = draw(st.integers(0, s - 1))
        mask[start : start + draw(st.integers(2, 9))] = True
    return spans_of_mask(mask[None])[0]


@st.composite
def case(draw):
    method = draw(st.sampled_from(["ring", "ring", "ulysses", "usp"]))
    n = 4 if method == "usp" else draw(st.integers(2, 4))
    layout = draw(st.sampled_from(ringkv.LAYOUTS))
    per = 2 if layout == "zigzag" else 1
    s = n * per * draw(st.integers(2, 5 if method == "usp" else 3))
    b = draw(st.integers(1, 2))
    kinds = draw(st.lists(st.sampled_from(["none", "one", "several"]), min_size=b, max_size=b))
    return dict(
        method=method,
        n=n,
        layout=layout,
        b=b,
        s=s,
        hkv=(hkv := draw(st.sampled_from([1, 2]))),
        h=hkv * draw(st.sampled_from([1, 2])) * (4 if method != "ring" else 1),  # ulysses: h >= n
        window=draw(st.sampled_from([(-1, -1), (2, 0), (5, 0)])),
        spans=[draw(spans_row(s, kind)) for kind in kinds],
        lse_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _fixed(method, n, layout, s, spans, window=(-1, -1), b=1):
    return dict(
        method=method, n=n, layout=layout, b=b, s=s, hkv=2, h=4, window=window,
        spans=spans, lse_grad=True, seed=3,
    )  # fmt: skip


@settings(max_examples=8, **SETTINGS)
@given(c=case())
# spans crossing every rank boundary (contiguous: 4 tokens a rank), a window shorter than a span
@example(c=_fixed("ring", 3, "contiguous", 12, [[(2, 11)]], window=(2, 0)))
@example(c=_fixed("ring", 2, "zigzag", 16, [[(1, 4), (6, 14)], []], b=2))  # rows differ
@example(c=_fixed("ulysses", 2, "striped", 12, [[(0, 5), (7, 12)]], window=(3, 0)))
@example(c=_fixed("usp", 4, "zigzag", 16, [[(3, 13)]]))
def test_spans_match_float64_reference(world, c):
    g = torch.Generator().manual_seed(c["seed"])
    b, s, h, hkv = c["b"], c["s"], c["h"], c["hkv"]
    q = torch.randn(b, s, h, 16, generator=g)
    k, v = (torch.randn(b, s, hkv, 16, generator=g) for _ in range(2))
    dout = torch.randn(b, s, h, 16, generator=g)
    dlse = torch.randn(b, h, s, generator=g) if c["lse_grad"] else None
    mask = oracle_mask(c["spans"], b, s, c["window"][0])
    want = reference(q, k, v, dout, dlse, mask)
    dims = (2, 2) if c["method"] == "usp" else None
    args = (c["method"], q, k, v, dout, dlse, c["layout"], c["window"], c["spans"], dims)
    results = world.check("tests.span_cases:forward_backward", c["n"], *args)
    for rank, (out, lse, dq, dk, dv, pos) in enumerate(results):
        for name, got, full, dim in zip(
            ("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want, (1, 2, 1, 1, 1)
        ):
            assert_close(f"{name} rank {rank} {c}", got, full.index_select(dim, pos), 1e-5)


def test_spans_bad_input_is_refused_before_any_collective():
    q = k = v = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="causal=True"):
        ringkv.ring_attention(q, k, v, causal=False, spans=[[(0, 3)]])
    with pytest.raises(ValueError, match="causal=True"):
        ringkv.ring_attention(q, k, v, causal=True, spans=[[(0, 3)]], cu_seqlens=[0, 8])
    for bad in ([[(3, 2)]], [[(0, 9)]], [[(0, 4), (2, 6)]], [[(0, 4)], []]):
        with pytest.raises(ValueError, match="spans"):
            ringkv.ring_attention(q, k, v, causal=True, spans=bad)
    with pytest.raises(TypeError, match="spans_of_mask"):
        ringkv.ring_attention(q, k, v, causal=True, spans=torch.zeros(1, 8, dtype=torch.bool))


def test_span_calls_cover_each_span_once_in_every_layout():
    """Over all ring steps the extra calls cover exactly the pairs ``q < k`` of one span."""
    spans = (((1, 7), (9, 16)),)
    for layout in ringkv.LAYOUTS:
        n, s = 4, 16
        shards = [tuple(chunks(s, layout, r, n)) for r in range(n)]
        seen = torch.zeros(s, s, dtype=torch.int)
        for r in range(n):
            for src in range(n):
                qp = torch.tensor([p for rg in shards[r] for p in rg])
                kp = torch.tensor([p for rg in shards[src] for p in rg])
                for _, qs, ks, mask in span_calls(shards[r], shards[src], spans):
                    vis = mask.visible(qs.stop - qs.start, ks.stop - ks.start)
                    i, j = vis.nonzero().unbind(1)
                    seen[qp[qs][i], kp[ks][j]] += 1
        want = oracle_mask([list(spans[0])], 1, s, -1)[0] & ~oracle_mask([[]], 1, s, -1)[0]
        assert torch.equal(seen, want.int()), layout
