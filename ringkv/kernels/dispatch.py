"""Which backend runs an attention call: the registry, the one-time probes and ``"auto"``.

- ``BACKENDS``: name -> module with ``supports(q, mask, dlse=False)``, ``forward(q, k, v, scale,
  mask) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, scale, mask, dlse=None) -> fp32
  (dq, dk, dv)`` (the contract of ``reference.py``); ``register_backend`` adds one; ``MISSING``:
  backends that could not be imported, and why. ``FEATURES`` of a module (``features``): what it
  does natively among ``"softcap"`` (then ``forward``/``backward`` take ``softcap=``) and ``"dv"``
  (V with its own head size). A call with a soft-cap never goes to a backend without it; a call
  with ``Dv != D`` runs on a backend without ``"dv"`` with the smaller side zero-padded (exact).
- ``PREFERENCE``: per device type, expected fastest first. The three tables are read-only views
  of ``REGISTRY`` (a ``BackendRegistry``), which also keeps the probe results: ``snapshot()``
  shows it, ``reset()`` forgets the probes and warnings, ``remove(name)`` a backend.
- ``pick(backend, q, mask, dlse=False, backward=False)``: the module for one call. ``"auto"``
  takes the first backend in the device's ``PREFERENCE`` order that supports the inputs and passed
  its one-time check against the reference (``_probe``: forward, backward and the gradient through
  lse, each on its own). A gradient through lse runs only on a backend that takes ``dlse``
  natively (``cpu_flash``, ``triton``, ``reference``): with no such backend usable, the reference
      runs it, by design.
- ``describe()``: which backend ``"auto"`` runs for each call, and why the others do not; on the
  CPU also each C kernel's build and self-check verdict (``native``).

The entry points that use this (``attention``, ``block_forward``, ...) are in the package
``ringkv.kernels``; this module imports the backends, never the package.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Dict, List, Optional

import torch

from . import cpu_flash, cudnn, flash_attn, reference, sdpa
from .mask import BAND, DENSE, FULL, OFFSET, Mask

# expected fastest first (published H100/A100 results, not measured by us): FlashAttention-3
# (Hopper), flash-attn 2, cuDNN, torch's flash SDPA, then our Triton kernels (never run on a GPU
# yet; registered after sdpa at the end of this file); each call takes the first that supports it
# and passed its probe.
# CPU: our C kernel (float32, faster than torch's fused op: docs/kernels.md), then torch's op
_BUILT_IN = {
    "reference": reference,
    "sdpa": sdpa,
    "cudnn": cudnn,
    "cpu_flash": cpu_flash,
    "flash_attn": flash_attn.FA2,
    "flash_attn3": flash_attn.FA3,
}
_ORDER = {
    "cuda": ["flash_attn3", "flash_attn", "cudnn", "sdpa", "reference"],
    "cpu": ["cpu_flash", "sdpa", "reference"],
}
NEEDS = ("forward", "backward", "lse_grad")


class BackendRegistry:
    """The attention backends of this process and what was learned about them: ``backends``
    (name -> module), ``preference`` (device type -> names, expected fastest first), ``missing``
    (name -> why it could not be imported), the one-time probe results and the warnings given.
    The three tables are read-only views; ``register``/``remove`` change them, ``reset`` forgets
    the probes and warnings, ``snapshot`` shows it all as plain data."""

    def __init__(self, backends: Dict[str, object], preference: Dict[str, List[str]]):
        self._backends = dict(backends)
        self._preference = {device: list(order) for device, order in preference.items()}
        self._missing: Dict[str, str] = {}
        self._verified: Dict[tuple, Dict[str, str]] = {}  # (name, device, dtype) -> need -> why
        self._warned: set = set()
        self.backends = MappingProxyType(self._backends)
        self.preference = MappingProxyType(self._preference)
        self.missing = MappingProxyType(self._missing)

    def register(self, name: str, module, preference: Optional[Dict[str, int]] = None) -> None:
        """Add backend ``name``; ``preference``: device type -> its index in that device's order
        (a name already in an order keeps its place)."""
        self._backends[name] = module
        for device, index in (preference or {}).items():
            order = self._preference.setdefault(device, ["reference"])
            if name not in order:
                order.insert(index, name)

    def mark_missing(self, name: str, why: str) -> None:
        """Record that backend ``name`` could not be imported, and why."""
        self._missing[name] = why

    def remove(self, name: str) -> None:
        """Forget backend ``name``: its module, its places in the orders and its probes."""
        self._backends.pop(name, None)
        self._missing.pop(name, None)
        for order in self._preference.values():
            if name in order:
                order.remove(name)
        for key in [k for k in self._verified if k[0] == name]:
            del self._verified[key]

    def probes(self, key: tuple) -> Dict[str, str]:
        """The probe results of ``(name, device type, dtype)``: need -> "" (passed) or why not."""
        return self._verified.setdefault(key, {})

    def warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def snapshot(self) -> dict:
        """Plain data: the backends' names, the orders, the missing ones, the probe results."""
        return dict(
            backends=sorted(self._backends),
            preference={device: list(order) for device, order in self._preference.items()},
            missing=dict(self._missing),
            probes={"/".join(map(str, k)): dict(v) for k, v in self._verified.items()},
        )

    def reset(self) -> None:
        """Forget the probe results and the warnings given (the next call probes again)."""
        self._verified.clear()
        self._warned.clear()


REGISTRY = BackendRegistry(_BUILT_IN, _ORDER)
BACKENDS = REGISTRY.backends  # read-only views (``register_backend`` adds a backend)
PREFERENCE = REGISTRY.preference
MISSING = REGISTRY.missing  # backends that could not even be imported: name -> why

__all__ = [
    "BACKENDS",
    "PREFERENCE",
    "NEEDS",
    "MISSING",
    "REGISTRY",
    "BackendRegistry",
    "register_backend",
    "pick",
    "describe",
    "features",
]


def features(module) -> frozenset:
    """What ``module`` does natively: a subset of ``{"softcap", "dv"}``."""
    return getattr(module, "FEATURES", frozenset())


def register_backend(name: str, module, preference: Optional[Dict[str, int]] = None) -> None:
    """Add a backend module with ``supports/forward/backward`` (same contract as ``reference``)."""
    REGISTRY.register(name, module, preference)


def _name(module) -> str:
    return next((n for n, m in BACKENDS.items() if m is module), repr(module))


def _close(a: torch.Tensor, e: torch.Tensor, tol: float) -> bool:
    """Same infinities, finite entries within ``tol * (1 + max |e|)``."""
    a, e = a.float(), e.float()
    inf = torch.isinf(e)
    if (
        not torch.equal(torch.isinf(a), inf)
        or not torch.equal(a[inf], e[inf])
        or torch.isnan(a).any()
    ):
        return False
    fin = ~inf
    return not fin.any() or (a[fin] - e[fin]).abs().max().item() <= tol * (
        1 + e[fin].abs().max().item()
    )


def _check(name: str, need: str, q: torch.Tensor, softcap: bool = False, dv: bool = False) -> str:
    """One need of one backend against the reference on a small GQA problem: "" or why it failed.
    ``softcap``/``dv``: the check of that native feature (a cap of 2, V of head size 32)."""
    module = BACKENDS[name]
    g = torch.Generator(device="cpu").manual_seed(0)
    dims = (64, 64, 32 if dv else 64, 32 if dv else 64)
    q, k, v, dout = [
        torch.randn(2, 77, s, d, generator=g).to(q.device, q.dtype)
        for s, d in zip((4, 2, 2, 4), dims)
    ]
    cap = dict(softcap=2.0) if softcap else {}
    dlse = torch.randn(2, 4, 77, generator=g).to(q.device) if need == "lse_grad" else None
    tol = max(16 * torch.finfo(q.dtype).eps, 1e-3)  # wrong arguments give errors of order 1
    masks = [
        m
        for m in (
            Mask(OFFSET, offset=-5),
            Mask(BAND, offset=3, lo=-20),
        )  # rows with no key included
        if module.supports(q, m, dlse is not None)
    ]
    if not masks:
        return "unsupported"
    try:
        for mask in masks:
            ref_out, ref_lse = reference.forward(q, k, v, 0.125, mask, **cap)
            if need == "forward":
                out, lse = module.forward(q, k, v, 0.125, mask, **cap)
                if not (_close(out, ref_out, tol) and _close(lse, ref_lse, 3e-3)):
                    return f"failed probe: forward differs from the reference (mask {mask.kind})"
                continue
            got = module.backward(dout, q, k, v, ref_out, ref_lse, 0.125, mask, dlse, **cap)
            want = reference.backward(dout, q, k, v, ref_out, ref_lse, 0.125, mask, dlse, **cap)
            if not all(_close(a, e, tol) for a, e in zip(got, want)):
                return f"failed probe: {need} differs from the reference (mask {mask.kind})"
    except Exception as e:  # a broken install or an API change must not break "auto"
        return f"failed probe: {type(e).__name__}: {e}"
    return ""


def _probe(
    name: str, q: torch.Tensor, need: str = "forward", softcap: bool = False, dv: bool = False
) -> str:
    """Check a backend once per (device, dtype, need, native feature) against the reference: "" or
    why not."""
    key = (name, q.device.type, q.dtype)
    results = REGISTRY.probes(key)
    need = need + ("+softcap" if softcap else "") + ("+dv" if dv else "")
    if need not in results:
        results[need] = _check(name, need.split("+")[0], q, softcap, dv)
        if results[need].startswith("failed"):
            REGISTRY.warn_once(
                (key, need),
                f"ringkv: backend {name!r} {results[need]} on {q.device.type} {q.dtype}; "
                f"'auto' runs the {need} elsewhere (ringkv.kernels.describe() says where)",
            )
    return results[need]


def _need(dlse: bool, backward: bool) -> str:
    return "lse_grad" if dlse else "backward" if backward else "forward"


def _skip_reason(
    name: str, q: torch.Tensor, mask: Mask, need: str, softcap: bool = False, dv: bool = False
) -> str:
    """Why ``auto`` passes over backend ``name`` for this call ("" when it may take it).
    ``softcap``: the call caps its scores; ``dv``: V's head size differs from q's."""
    module = BACKENDS.get(name)
    if module is None:
        return MISSING.get(name, "not registered")
    if getattr(module, "unavailable", ""):
        return module.unavailable
    declined = getattr(module, "declines", lambda m: "")(mask)  # on, but not for this kind of block
    if declined:
        return declined
    if softcap and "softcap" not in features(module):
        return "unsupported: no logit soft-capping"
    if not module.supports(q, mask, need == "lse_grad"):
        return "unsupported" + (
            " (takes no gradient through lse)"
            if need == "lse_grad" and module.supports(q, mask)
            else ""
        )
    return (
        ""
        if name == "reference"
        else _probe(name, q, need, softcap, dv and "dv" in features(module))
    )


def pick(
    backend: str,
    q: torch.Tensor,
    mask: Mask,
    dlse: bool = False,
    backward: bool = False,
    softcap: bool = False,
    dv: bool = False,
):
    """Resolve a backend name (or ``"auto"``) to a module for this call.

    ``backward``: the call is a backward; ``dlse``: a backward with a gradient through lse;
    ``softcap``: it caps its scores (only backends with the feature take it; a forced one without
    it is a ``ValueError`` naming ``softcap``); ``dv``: V has its own head size (a backend
    without the feature runs it padded, see ``ringkv.kernels``).
    ``"auto"`` takes the first backend in ``PREFERENCE`` that supports the call and passed its
    probe for it. An explicit backend that runs the backward but takes no ``dlse`` hands that
    call to ``"auto"`` (with a warning, once).
    """
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)} or 'auto'"
            )
        module = BACKENDS[backend]
        if softcap and "softcap" not in features(module):
            raise ValueError(
                f"softcap: backend {backend!r} has no logit soft-capping; use backend='auto' or "
                f"one of {sorted(n for n, m in BACKENDS.items() if 'softcap' in features(m))}"
            )
        if module.supports(q, mask, dlse):
            return module
        if dlse and module.supports(q, mask):
            chosen = pick("auto", q, mask, dlse=True, backward=True, softcap=softcap, dv=dv)
            REGISTRY.warn_once(
                ("dlse", backend, _name(chosen)),
                f"ringkv: backend {backend!r} takes no gradient through lse; backward calls with "
                f"one run on {_name(chosen)!r}",
            )
            return chosen
        raise ValueError(
            f"backend {backend!r} does not support {q.device.type} {q.dtype} "
            f"head_dim={q.shape[-1]} with mask {mask.kind!r}; use backend='auto'"
        )
    need = _need(dlse, backward)
    for name in PREFERENCE.get(q.device.type, ["reference"]):
        if not _skip_reason(name, q, mask, need, softcap, dv):
            return BACKENDS[name]
    return reference


_SAMPLE_MASKS = {
    FULL: lambda s: Mask(FULL),
    OFFSET: lambda s: Mask(OFFSET),
    BAND: lambda s: Mask(BAND, offset=0, lo=-s // 4),
    DENSE: lambda s: Mask(
        DENSE, dense=torch.rand(s, s, generator=torch.Generator().manual_seed(0)) < 0.5
    ),
}


def describe(device=None, dtype=None, head_dim: int = 128) -> dict:
    """Which backend ``"auto"`` runs for each call on ``device``/``dtype``, and why not the others.

    Runs the one-time probes it needs. Returns ``{"device", "dtype", "order", "auto", "skipped",
    "notes"}`` (and ``"native"`` on the CPU): ``auto[need][mask kind]`` is a backend name for each
    need in ``NEEDS`` (forward, backward, lse_grad) and mask kind (full, offset, band, dense; EMPTY
    blocks never reach a backend); ``skipped[name]`` is why another backend is not used: one string
    when the reason is the same for every call, else ``{"need/kind": reason}`` for the calls it does
    not run.
    ``auto_softcap``: like ``auto`` for calls with a soft-cap; ``features[name]``: how each backend
    takes a soft-cap (native or not at all) and V with its own head size (native or zero-padded).
    On the CPU, ``native[kernel]`` (``flash_attention``, ``flash_attention (full)``: its verdict on
    full blocks, ``linear``, ``paged_attention``) is each C
    kernel's verdict (``native.self_check``: its ISA and tiles, ``on``, ``by`` what, ``why`` not,
    ``kernel_us`` and ``torch_us`` from its self-check); running it may run the self-checks.
    """
    device = torch.device(
        device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    q = torch.zeros(1, 64, 2, head_dim, device=device, dtype=dtype)
    order = PREFERENCE.get(device.type, ["reference"])
    auto, skipped = _auto_table(q, order)
    auto_softcap = {
        need: {
            kind: _name(
                pick(
                    "auto",
                    q,
                    make(q.shape[1]),
                    dlse=need == "lse_grad",
                    backward=need != "forward",
                    softcap=True,
                )
            )
            for kind, make in _SAMPLE_MASKS.items()
        }
        for need in NEEDS
    }
    feats = {
        n: {
            "softcap": "native" if "softcap" in features(m) else "no (skipped for capped calls)",
            "dv": "native" if "dv" in features(m) else "zero-padded to max(D, Dv)",
        }
        for n, m in BACKENDS.items()
    }
    notes = []
    if "reference" in auto["lse_grad"].values():
        notes.append(
            "lse_grad on 'reference': no backend usable here takes a gradient through lse natively "
            "(only 'cpu_flash' does, float32 on CPU, and 'triton', for full/offset masks on CUDA), "
            "so the reference runs those backward calls, by design"
        )
    out = dict(
        device=str(device),
        dtype=str(dtype),
        order=list(order),
        auto=auto,
        skipped=skipped,
        notes=notes,
        auto_softcap=auto_softcap,
        features=feats,
    )
    if device.type == "cpu":
        out["native"] = _native()
    return out


def _auto_table(q: torch.Tensor, order) -> tuple:
    """``(auto, skipped)`` of ``describe`` for ``q``'s device and dtype."""
    auto, cells = {}, {}
    for need in NEEDS:
        auto[need] = {}
        for kind, make in _SAMPLE_MASKS.items():
            mask = make(q.shape[1])
            chosen = _name(
                pick("auto", q, mask, dlse=need == "lse_grad", backward=need != "forward")
            )
            auto[need][kind] = chosen
            for name in sorted(set(BACKENDS) | set(MISSING)):
                if name == chosen:
                    continue
                why = MISSING.get(name) or getattr(BACKENDS[name], "unavailable", "")
                if not why and name not in order:
                    why = f"not in the {q.device.type} preference order"
                elif not why and order.index(name) > order.index(chosen):
                    why = f"after {chosen!r} in the preference order"
                cells.setdefault(name, {})[f"{need}/{kind}"] = why or _skip_reason(
                    name, q, mask, need
                )
    skipped = {
        n: (next(iter(c.values())) if len(set(c.values())) == 1 else c) for n, c in cells.items()
    }
    return auto, skipped


def _native() -> dict:
    """Each C kernel's verdict (``native.self_check``), by kernel name."""
    from . import linear_cpu, paged_cpu, pointwise

    return {
        s["kernel"]: s
        for s in (
            cpu_flash.status(),
            cpu_flash.status("full"),
            linear_cpu.status(),
            paged_cpu.status(),
            pointwise.status(),
        )
    }


try:  # own Triton kernels (after sdpa, before reference on CUDA) when triton is installed
    from . import triton_attn
except ImportError as e:
    REGISTRY.mark_missing("triton", f"not installed ({e})")
else:
    register_backend("triton", triton_attn, preference={"cuda": 4})
