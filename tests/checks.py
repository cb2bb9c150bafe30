"""Assertions the kernel tests share."""

from __future__ import annotations

import torch


def assert_close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """``got`` matches ``want``, compared in float64 on the CPU: the same shape, no NaN, the same
    infinities (with their signs) in the same places, and finite entries within
    ``tol * (1 + max |want|)``. ``what`` names the tensor in the failure message."""
    a, e = got.detach().double().cpu(), want.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN in the result"
    assert torch.equal(torch.isinf(a), torch.isinf(e)) and torch.equal(
        a[torch.isinf(a)], e[torch.isinf(e)]
    ), f"{what}: infinities differ"
    fin = torch.isfinite(e)
    if fin.any():
        err = (a[fin] - e[fin]).abs().max().item()
        bound = tol * (1 + e[fin].abs().max().item())
        assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
