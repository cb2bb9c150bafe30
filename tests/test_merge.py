"""LSE merge of partial attention results (``ringkv.kernels.merge``) against attention over all
keys."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringkv.kernels import attention
from ringkv.kernels.merge import merge, merge_


INF = float("-inf")


def start(b, sq, h, d):
    """An empty accumulator: out (B, Sq, H, D) = 0 fp32, lse (B, H, Sq) = -inf."""
    return torch.zeros(b, sq, h, d), torch.full((b, h, sq), INF)


def assert_same(got_out, got_lse, want_out, want_lse, atol=1e-5):
    assert got_out.dtype == got_lse.dtype == torch.float32
    assert not torch.isnan(got_out).any() and not torch.isnan(got_lse).any()
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse)), "-inf pattern differs"
    torch.testing.assert_close(got_out, want_out.float(), atol=atol, rtol=atol)
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(got_lse[fin], want_lse[fin].float(), atol=atol, rtol=atol)


@st.composite
def split_problems(draw):
    b, sq, sk = draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(0, 30))
    hkv = draw(st.integers(1, 2))
    h, d = hkv * draw(st.sampled_from([1, 3])), draw(st.sampled_from([16, 32]))
    causal = draw(st.booleans())
    if draw(
        st.booleans()
    ):  # a query chunk somewhere along the keys: early chunks see nothing later
        step = draw(st.integers(1, 3))
        q_pos = range(a := draw(st.integers(-5, sk + 5)), a + sq * step, step)
        k_pos = range(0, sk * step, step)
    else:  # arbitrary positions, duplicates included
        q_pos = torch.tensor(
            draw(st.lists(st.integers(0, 20), min_size=sq, max_size=sq)), dtype=torch.long
        )
        k_pos = torch.tensor(
            draw(st.lists(st.integers(0, 20), min_size=sk, max_size=sk)), dtype=torch.long
        )
    cuts = sorted(draw(st.lists(st.integers(0, sk), max_size=5)))  # repeated cuts: empty pieces
    bounds = [0] + cuts + [sk]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    order = draw(st.permutations(range(len(pieces))))
    return dict(
        b=b,
        sq=sq,
        sk=sk,
        h=h,
        hkv=hkv,
        d=d,
        causal=causal,
        q_pos=q_pos,
        k_pos=k_pos,
        pieces=[pieces[i] for i in order],
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=60)
@given(split_problems())
def test_merged_pieces_equal_attention_over_all_keys(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["b"], p["sq"], p["h"], p["d"], generator=g)
    k, v = (torch.randn(p["b"], p["sk"], p["hkv"], p["d"], generator=g) for _ in range(2))
    kw = dict(causal=p["causal"], q_positions=p["q_pos"], backend="reference")
    want_out, want_lse = attention(q, k, v, k_positions=p["k_pos"], **kw)

    acc, lse = start(p["b"], p["sq"], p["h"], p["d"])
    outs, lses = [], []
    for lo, hi in p["pieces"]:  # in a random order: merging is order-independent
        o, ls = attention(q, k[:, lo:hi], v[:, lo:hi], k_positions=p["k_pos"][lo:hi], **kw)
        merge_(acc, lse, o, ls)
        outs.append(o)
        lses.append(ls)
    assert_same(acc, lse, want_out, want_lse)
    assert_same(*merge(outs, lses), want_out, want_lse)


def test_lse_gaps_of_1e4_do_not_overflow():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 6, 3, 8, generator=g), torch.randn(2, 6, 3, 8, generator=g)
    lse_a = torch.randn(2, 3, 6, generator=g)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])  # per row: b dominates or a does
    lse_b = lse_a + 1e4 * sign
    b_wins = (sign > 0).view(1, 6, 1, 1)
    want_out = torch.where(b_wins, b, a)
    want_lse = torch.maximum(lse_a, lse_b)
    for base in (0.0, 1e4, -1e4):  # also large absolute values
        acc, lse = start(2, 6, 3, 8)
        merge_(acc, lse, a, lse_a + base)
        merge_(acc, lse, b, lse_b + base)
        assert_same(acc, lse, want_out, want_lse + base)
        assert_same(*merge([a, b], [lse_a + base, lse_b + base]), want_out, want_lse + base)


def test_rows_without_keys_stay_zero_and_minus_inf():
    g = torch.Generator().manual_seed(1)
    junk = torch.randn(1, 4, 2, 8, generator=g)  # a partial's out is ignored where its lse is -inf
    blind = torch.full((1, 2, 4), INF)
    half = blind.clone()
    half[..., :2] = torch.randn(1, 2, 2, generator=g)  # rows 0, 1 see keys, rows 2, 3 do not
    acc, lse = start(1, 4, 2, 8)
    for o, ls in [(junk, blind), (junk, half), (junk * 3, blind)]:
        merge_(acc, lse, o, ls)
    want_out = torch.cat([junk[:, :2], torch.zeros(1, 2, 2, 8)], dim=1)
    assert_same(acc, lse, want_out, half)
    assert torch.equal(acc[:, 2:], torch.zeros(1, 2, 2, 8))
    assert_same(
        *merge([junk, junk * 3], [blind, half]),
        torch.cat([3 * junk[:, :2], torch.zeros(1, 2, 2, 8)], 1),
        half,
    )
    out, lse = merge([junk, junk], [blind, blind])  # nothing seen anywhere
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@settings(max_examples=25)
@given(st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_bf16_block_outs_merge_in_fp32(n, seed):
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(2, 5, 3, 16, generator=g).bfloat16() for _ in range(n)]
    lses = [4 * torch.randn(2, 3, 5, generator=g) for _ in range(n)]
    # float64 formula on the same (bf16-rounded) values
    lse64 = torch.logsumexp(torch.stack(lses).double(), 0)  # (B, H, S)
    out64 = sum(
        o.double() * torch.exp(ls.double() - lse64).transpose(1, 2)[..., None]
        for o, ls in zip(outs, lses)
    )
    acc, lse = start(2, 5, 3, 16)
    for o, ls in zip(outs, lses):
        merge_(acc, lse, o, ls)
    assert_same(acc, lse, out64, lse64, atol=1e-5)
    assert_same(*merge(outs, lses), out64, lse64, atol=1e-5)


def test_merge_into_strided_views():
    # the ring merges into views of its accumulator (e.g. one zigzag half's rows)
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 8, 2, 16, generator=g),
        torch.randn(1, 10, 2, 16, generator=g),
        torch.randn(1, 10, 2, 16, generator=g),
    )
    kw = dict(causal=True, q_positions=range(1, 9), backend="reference")
    want_out, want_lse = attention(q, k, v, **kw)
    acc, lse = start(1, 8, 2, 16)
    for rows in (slice(0, 8, 2), slice(1, 8, 2)):  # even rows, odd rows
        qpos = torch.arange(1, 9)[rows]
        for lo, hi in ((0, 4), (4, 10)):
            o, ls = attention(
                q[:, rows],
                k[:, lo:hi],
                v[:, lo:hi],
                causal=True,
                q_positions=qpos,
                k_positions=range(lo, hi),
                backend="reference",
            )
            merge_(acc[:, rows], lse[:, :, rows], o, ls)
    assert_same(acc, lse, want_out, want_lse)
