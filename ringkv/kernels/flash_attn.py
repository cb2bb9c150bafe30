"""flash-attn 2 (``flash_attn``, 2.6-2.8) and FlashAttention-3 (``flash_attn_interface``). Never
required.

Two backends, ``FA2`` (registered as ``"flash_attn"``) and ``FA3`` (``"flash_attn3"``), each usable
when its package imports: CUDA, fp16/bf16, head_dim <= 256 and a multiple of 8, ``(B, S, H, D)``
with GQA natively. Offset-diagonal masks are split into full tiles and one square causal tile
(``mask.offset_tiles``), as in ``sdpa``. A window band runs as one call with the native window on
the rows that see a key and the keys they see (see ``_tiles``), so no row of a call is fully masked.

We call the packages' *private* ``_flash_attn_forward`` / ``_flash_attn_backward``: the forward
without autograd, and the backward from the rows' final out/lse (no public function takes those).
Their argument lists change between releases, so ``FA2_ADAPTERS`` / ``FA3_ADAPTERS`` map our one
call to each release's list. The entry is chosen once at import, flash-attn 2 by its version and
FA3 (which has no version of its own) by its parameter names, and the installed functions'
parameters are checked against it: a mismatch leaves the backend unusable with the reason in
``unavailable`` (shown by ``kernels.describe()``), never a call with misplaced arguments.
Not exercised in CI (both need CUDA); ``"auto"`` only picks them after a one-time check of
forward and backward against the reference on the device (``dispatch._probe``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .merge import empty_partial, merge_
from .mask import BAND, DENSE, EMPTY, FULL, Mask, offset_tiles


@dataclass(frozen=True)
class Adapter:
    """How one release spells our two calls.

    ``fwd(fn, q, k, v, scale, causal, window, softcap) -> (out, lse)``;
    ``bwd(fn, dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap)`` fills dq, dk,
    dv.
    ``fwd_params``/``bwd_params``: the release's leading parameter names, the ones we pass
    positionally (any later parameter must have a default). ``softcap``: the release caps scores
    in its forward and backward (``softcap`` 0 = off), and the adapter passes ours.
    """

    name: str
    versions: Optional[
        Tuple[Tuple[int, int], Tuple[int, int]]
    ]  # [low, high) (major, minor); None: FA3
    fwd_params: Tuple[str, ...]
    bwd_params: Tuple[str, ...]
    fwd: Callable
    bwd: Callable
    softcap: bool = False


_QKV = ("q", "k", "v")
_GRAD_IN = ("dout", "q", "k", "v", "out", "softmax_lse")


# flash-attn 2.6.0-2.6.3, flash_attn/flash_attn_interface.py: window as one tuple; the forward
# returns (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
def _fa26_fwd(fn, q, k, v, scale, causal, window, softcap=0.0):
    out, _, _, _, _, lse, _, _ = fn(
        q, k, v, 0.0, scale, causal, tuple(window), softcap, None, False
    )
    return out, lse


def _fa26_bwd(fn, dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap=0.0):
    fn(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        0.0,
        scale,
        causal,
        tuple(window),
        softcap,
        None,
        False,
        None,
    )


# flash-attn 2.7.0-2.8.x (torch custom ops since 2.7.0): window as left, right; the forward returns
# (out, softmax_lse, S_dmask, rng_state); the backward fills dq, dk, dv and returns softmax_d
def _fa27_fwd(fn, q, k, v, scale, causal, window, softcap=0.0):
    out, lse, _, _ = fn(q, k, v, 0.0, scale, causal, window[0], window[1], softcap, None, False)
    return out, lse


def _fa27_bwd(fn, dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap=0.0):
    fn(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        0.0,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        None,
        False,
        None,
    )


FA2_ADAPTERS = (
    Adapter(
        "flash-attn 2.6",
        ((2, 6), (2, 7)),
        _QKV
        + (
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size",
            "softcap",
            "alibi_slopes",
            "return_softmax",
        ),
        _GRAD_IN
        + (
            "dq",
            "dk",
            "dv",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size",
            "softcap",
            "alibi_slopes",
            "deterministic",
            "rng_state",
        ),
        _fa26_fwd,
        _fa26_bwd,
        softcap=True,
    ),
    Adapter(
        "flash-attn 2.7-2.8",
        ((2, 7), (2, 9)),
        _QKV
        + (
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "return_softmax",
        ),
        _GRAD_IN
        + (
            "dq",
            "dk",
            "dv",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "deterministic",
            "rng_state",
        ),
        _fa27_fwd,
        _fa27_bwd,
        softcap=True,
    ),
)

# FlashAttention-3, hopper/flash_attn_interface.py: 20 optional inputs (new KV, paging, rotary,
# fp8 descales, varlen) between v and the scale, which we pass as None; 6 varlen ones in the
# backward
_FA3_FWD_NONE = (
    "k_new",
    "v_new",
    "qv",
    "out",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "cu_seqlens_k_new",
    "seqused_q",
    "seqused_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "page_table",
    "kv_batch_idx",
    "leftpad_k",
    "rotary_cos",
    "rotary_sin",
    "seqlens_rotary",
    "q_descale",
    "k_descale",
    "v_descale",
)
_FA3_BWD_NONE = (
    "cu_seqlens_q",
    "cu_seqlens_k",
    "sequed_q",
    "sequed_k",
    "max_seqlen_q",
    "max_seqlen_k",
)


# as of tags v2.8.0-v2.8.3: window as one tuple; backward returns (dq, dk, dv, softmax_d)
def _fa3_tuple_fwd(fn, q, k, v, scale, causal, window, softcap=0.0):
    out, lse, *_ = fn(q, k, v, *(None,) * len(_FA3_FWD_NONE), scale, causal, tuple(window))
    return out, lse


def _fa3_tuple_bwd(fn, dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap=0.0):
    fn(
        dout,
        q,
        k,
        v,
        out,
        lse,
        *(None,) * len(_FA3_BWD_NONE),
        dq,
        dk,
        dv,
        scale,
        causal,
        tuple(window),
    )


# after v2.8.3 (torch custom ops): window as left, right; the output buffer renamed ``out_``, the
# backward's flag ``is_causal``; forward returns (out, lse, out_accum, lse_accum), backward
# softmax_d
def _fa3_split_fwd(fn, q, k, v, scale, causal, window, softcap=0.0):
    out, lse, *_ = fn(q, k, v, *(None,) * len(_FA3_FWD_NONE), scale, causal, window[0], window[1])
    return out, lse


def _fa3_split_bwd(fn, dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap=0.0):
    fn(
        dout,
        q,
        k,
        v,
        out,
        lse,
        *(None,) * len(_FA3_BWD_NONE),
        dq,
        dk,
        dv,
        scale,
        causal,
        window[0],
        window[1],
    )


FA3_ADAPTERS = (
    Adapter(
        "FlashAttention-3 (window_size tuple, v2.8.0-v2.8.3)",
        None,
        _QKV + _FA3_FWD_NONE + ("softmax_scale", "causal", "window_size"),
        _GRAD_IN + _FA3_BWD_NONE + ("dq", "dk", "dv", "softmax_scale", "causal", "window_size"),
        _fa3_tuple_fwd,
        _fa3_tuple_bwd,
    ),
    Adapter(
        "FlashAttention-3 (window_size_left/right, after v2.8.3)",
        None,
        _QKV
        + tuple("out_" if p == "out" else p for p in _FA3_FWD_NONE)
        + ("softmax_scale", "causal", "window_size_left", "window_size_right"),
        _GRAD_IN
        + _FA3_BWD_NONE
        + ("dq", "dk", "dv", "softmax_scale", "is_causal", "window_size_left", "window_size_right"),
        _fa3_split_fwd,
        _fa3_split_bwd,
    ),
)


def _fits(fn, names: Tuple[str, ...]) -> bool:
    """``fn``'s parameters start with ``names`` and all later ones have defaults."""
    params = list(
        inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values()
    )  # custom ops wrap a def
    return tuple(p.name for p in params[: len(names)]) == names and all(
        p.default is not p.empty for p in params[len(names) :]
    )


def _version(text: str) -> Tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def select(table, fwd_fn, bwd_fn, version: Optional[str] = None):
    """``(adapter, "")`` for the installed functions, or ``(None, why not)``."""
    ranged = [
        a
        for a in table
        if a.versions is None or a.versions[0] <= _version(version or "") < a.versions[1]
    ]
    if not ranged:
        span = (
            f"{table[0].versions[0][0]}.{table[0].versions[0][1]}-"
            f"{table[-1].versions[1][0]}.{table[-1].versions[1][1] - 1}"
        )
        return None, f"version {version} is outside the supported {span}"
    for adapter in ranged:
        if _fits(fwd_fn, adapter.fwd_params) and _fits(bwd_fn, adapter.bwd_params):
            return adapter, ""
    return None, (
        f"private _flash_attn_forward/_flash_attn_backward{' of ' + version if version else ''} "
        f"match none of: {', '.join(a.name for a in ranged)}"
    )


def _tiles(mask: Mask, sq: int, sk: int):
    """Calls ``(rows, keys, causal, window_size)`` covering the mask once, in flash-attn's terms."""
    if mask.kind == FULL:
        return [(slice(0, sq), slice(0, sk), False, (-1, -1))]
    if mask.kind == BAND:  # i + lo <= j <= i + hi
        lo, hi = mask.lo, mask.offset
        r0, r1 = max(0, -hi), min(sq - 1, sk - 1 - lo)  # the rows that see at least one key
        c0, c1 = max(0, r0 + lo), min(sk - 1, r1 + hi)  # the keys those rows see
        # flash-attn aligns bottom-right: j' visible iff i' + shift - left <= j' <= i' + shift +
        # right
        shift = (c1 - c0) - (r1 - r0)
        left, right = shift - (lo + r0 - c0), (hi + r0 - c0) - shift  # both >= 0 after the trim
        return [(slice(r0, r1 + 1), slice(c0, c1 + 1), False, (left, right))]
    return [
        (slice(t.q0, t.q1), slice(t.k0, t.k1), t.causal, (-1, -1))
        for t in offset_tiles(mask.offset, sq, sk)
    ]


class FlashBackend:
    """One flash-attn package behind the backend contract (``supports/forward/backward``)."""

    def __init__(
        self, name: str, module, table, version: Optional[str] = None, unavailable: str = ""
    ):
        self.name, self.module, self.adapter, self.unavailable = name, module, None, unavailable
        self.FEATURES = frozenset()  # V's own head size runs zero-padded (see ringkv.kernels)
        if module is not None:
            self.adapter, why = select(
                table, module._flash_attn_forward, module._flash_attn_backward, version
            )
            self.unavailable = "" if self.adapter else why
            if (
                self.adapter is not None and self.adapter.softcap
            ):  # FA3's capped backward is not wired (untested)
                self.FEATURES = frozenset({"softcap"})

    def __repr__(self):
        return f"<backend {self.name}: {self.adapter.name if self.adapter else self.unavailable}>"

    def supports(self, q: torch.Tensor, mask: Mask, dlse=False) -> bool:
        return (
            self.adapter is not None
            and q.device.type == "cuda"
            and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0
            and mask.kind != DENSE
            and not dlse
        )

    def _fwd(self, q, k, v, scale: float, causal: bool, window, softcap=None):
        o, ls = self.adapter.fwd(
            self.module._flash_attn_forward, q, k, v, scale, causal, window, softcap or 0.0
        )
        return o, ls.float()

    @torch.no_grad()
    def forward(self, q, k, v, scale: float, mask: Mask, softcap=None):
        """Same contract as ``reference.forward``; one call over all rows is returned unmerged."""
        tiles = [] if mask.kind == EMPTY else _tiles(mask, q.shape[1], k.shape[1])
        if len(tiles) == 1 and tiles[0][0] == slice(0, q.shape[1]):
            _, c, causal, window = tiles[0]
            return self._fwd(q, k[:, c], v[:, c], scale, causal, window, softcap)
        acc, lse = empty_partial(*q.shape[:3], v.shape[-1], q.device)
        self.forward_into(q, k, v, scale, mask, acc, lse, softcap)
        return acc.to(q.dtype), lse

    @torch.no_grad()
    def forward_into(self, q, k, v, scale: float, mask: Mask, out, lse, softcap=None) -> None:
        """Each call's partial merged once, straight into the float32 accumulator
        ``out``/``lse``."""
        if mask.kind == EMPTY:
            return
        for r, c, causal, window in _tiles(mask, q.shape[1], k.shape[1]):
            merge_(
                out[:, r],
                lse[:, :, r],
                *self._fwd(q[:, r], k[:, c], v[:, c], scale, causal, window, softcap),
            )

    @torch.no_grad()
    def backward(self, dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None, softcap=None):
        """Same contract as ``reference.backward`` without ``dlse`` (the registry routes that)."""
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]
        self.backward_into(*grads, dout, q, k, v, out, lse, scale, mask, dlse, softcap)
        return tuple(grads)

    @torch.no_grad()
    def backward_into(
        self, dq, dk, dv, dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None, softcap=None
    ) -> None:
        """``backward`` added in place into float32 ``dq``, ``dk``, ``dv`` (views allowed), call by
        call."""
        assert dlse is None
        if mask.kind == EMPTY:
            return
        lse = torch.where(
            torch.isinf(lse), torch.zeros_like(lse), lse
        ).contiguous()  # no-key rows: P = 0
        for r, c, causal, window in _tiles(mask, q.shape[1], k.shape[1]):
            qs, ks, vs = q[:, r].contiguous(), k[:, c].contiguous(), v[:, c].contiguous()
            g = [torch.empty_like(t) for t in (qs, ks, vs)]
            self.adapter.bwd(
                self.module._flash_attn_backward,
                dout[:, r].contiguous(),
                qs,
                ks,
                vs,
                out[:, r].contiguous(),
                lse[:, :, r].contiguous(),
                *g,
                scale,
                causal,
                window,
                softcap or 0.0,
            )
            dq[:, r] += g[0]
            dk[:, c] += g[1]
            dv[:, c] += g[2]


def load(name: str, module_name: str, table, dist: Optional[str] = None) -> FlashBackend:
    """Import ``module_name`` if it is there and wrap it (unusable, with the reason, if not)."""
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or a broken CUDA install
        return FlashBackend(
            name, None, table, unavailable=f"not installed ({type(e).__name__}: {e})"
        )
    version = None
    if dist is not None:
        version = getattr(importlib.import_module(dist), "__version__", None) or "unknown"
    return FlashBackend(name, module, table, version)


FA2 = load("flash_attn", "flash_attn.flash_attn_interface", FA2_ADAPTERS, dist="flash_attn")
FA3 = load("flash_attn3", "flash_attn_interface", FA3_ADAPTERS)
