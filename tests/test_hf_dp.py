"""Data x sequence parallel (a ``(dp, sp)`` DeviceMesh, DDP, FSDP2) and torch.compile of a model
patched by ``ringkv.patch_model``, on the session's gloo world (cases in tests/hf_cases.py).

The gradient rule: the SP ranks of one replica hold shares of one loss (their gradients *sum*
to the replica's), the replicas hold different batches (their gradients *average*). Reduced that
way, every rank's gradients equal one process's gradients of the mean loss over the union of
the replicas' batches.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_cases import build

_TOL = dict(atol=5e-5, rtol=1e-4)


def _ids(b, s, seed, vocab=128):
    return torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _union_reference(arch, seed, batches):
    """One process, the unpatched model, the union of the batches (rows concatenated): loss and
    grads."""
    pairs = [b if isinstance(b, (tuple, list)) else (b, b) for b in batches]
    ids, labels = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    model = build(arch, seed).train()
    out = model(ids, labels=labels, use_cache=False)
    out.loss.backward()
    losses = []
    for i, lab in pairs:  # each replica's own loss (unpatched, alone)
        with torch.no_grad():
            losses.append(build(arch, seed)(i, labels=lab, use_cache=False).loss.item())
    return out.loss.item(), losses, {n: p.grad for n, p in model.named_parameters()}


def _check_dp_sp(world, arch, batches, layout, recipe, sp_arg="mesh_dim", weighted=False, seed=0):
    union_loss, losses, grads = _union_reference(arch, seed, batches)
    res = world.check(
        "tests.hf_cases:dp_sp_train", 4, arch, seed, batches, layout, recipe, sp_arg, weighted
    )
    assert sorted((r["dp"], r["sp"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in res:  # every rank reports its replica's mean loss
        assert r["loss"] == pytest.approx(losses[r["dp"]], rel=1e-5, abs=1e-6), (
            r["dp"],
            r["loss"],
            losses,
        )
    if not weighted:  # equal token counts: the mean of the replicas' means is the union's mean
        assert sum(losses) / len(losses) == pytest.approx(union_loss, rel=1e-5)
    for r in res:
        assert set(r["grads"]) == set(grads)
        for name, want in grads.items():
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(
                r["grads"][name],
                want,
                atol=2e-5 * scale,
                rtol=1e-4,
                msg=lambda m: f"rank dp={r['dp']} sp={r['sp']} grad {name}: {m}",
            )


@pytest.mark.parametrize(
    "arch,layout,s,recipe,sp_arg",
    [
        ("llama", "zigzag", 16, "manual", "mesh_dim"),
        ("qwen2", "striped", 13, "manual", "submesh"),  # padded to 14; group=mesh["sp"]
        ("llama", "zigzag", 17, "ddp", "mesh_dim"),  # DDP over dp, then the SP sum
        ("mistral", "contiguous", 12, "ddp_all", "group"),  # DDP over dp x sp, loss * sp
        ("llama", "zigzag", 16, "fsdp", "mesh_dim"),  # FSDP2 over mesh["dp"], then the SP sum
        ("qwen2", "zigzag", 12, "hsdp", "mesh_dim"),  # FSDP2 over the 2-D mesh (HSDP), loss * sp
    ],
)
def test_dp2_sp2_gradients_equal_the_union_batch(world, arch, layout, s, recipe, sp_arg):
    batches = [_ids(2, s, 1), _ids(2, s, 2)]
    _check_dp_sp(world, arch, batches, layout, recipe, sp_arg)


def test_dp2_sp2_token_weighted_mean_with_unequal_label_counts(world):
    """Replicas with different numbers of label tokens: scaling each replica's loss by
    ``dp * n_d / sum(n)`` gives the union's token mean (the plain mean of means would not)."""
    a, b = _ids(1, 16, 3), _ids(1, 16, 4)
    la = a.clone()
    la[:, 10:] = -100  # replica 0: 9 label tokens, replica 1: 15
    batches = [(a, la), (b, b)]
    _check_dp_sp(world, "llama", batches, "zigzag", "ddp", weighted=True)
    # the unweighted recipe gives the mean of the two means, which is not the union's
    union_loss, losses, _ = _union_reference("llama", 0, batches)
    assert abs(sum(losses) / 2 - union_loss) > 1e-3


def test_device_mesh_errors_and_groups(world):
    res = world.check("tests.hf_cases:mesh_errors", 4, 2)
    for rank, (no_dim, bad_name, bad_index, not_a_mesh, *groups) in enumerate(res):
        assert "2-D DeviceMesh" in no_dim and "mesh_dim='sp'" in no_dim, no_dim
        assert "'tp' is not a dimension" in bad_name and "('dp', 'sp')" in bad_name, bad_name
        assert "index 0..1" in bad_index, bad_index
        assert "pass the mesh as group=" in not_a_mesh, not_a_mesh
        d, s = divmod(rank, 2)
        sp_ranks = [2 * d, 2 * d + 1]
        assert groups[0] == groups[1] == (s, 2, sp_ranks)  # mesh_dim=1 and mesh["sp"]
        assert groups[2] == (d, 2, [s, s + 2])  # mesh_dim="dp" (an SP group of its own)


# ---- torch.compile ----


@pytest.mark.parametrize(
    "arch,layout,inputs,patch,backend",
    [
        ("llama", "zigzag", "full", dict(tile_mlp=3), "aot_eager"),
        ("qwen2", "striped", "shard", dict(keep_logits=True), "aot_eager"),
    ],
)
def test_compile_matches_eager_without_recompiles(world, arch, layout, inputs, patch, backend):
    """torch.compile of the patched model: forward + backward equal eager on every step, graphs
    are compiled once (new data of the same shape never recompiles: the steps after the first run
    with ``error_on_recompile``), and the only graph breaks are ringkv's hooks, attention and
    tiled MLPs, which run eagerly (``torch.compiler.disable``). The llama case trains with the
    chunked loss (no logits) and the MLP in tiles of 3 tokens; the qwen2 case keeps its logits.
    Both under ``aot_eager`` (dynamo and AOT autograd, as test_hf_families' compile tests):
    breaks, guards and recompiles are dynamo's, whatever the backend, and inductor's cold C++
    build of these graphs took 25-92 s of the suite (``backend="inductor"`` runs the same)."""
    batches = [_ids(1, 16, 10 + i) for i in range(3)]
    res = world.check(
        "tests.hf_cases:compile_train",
        2,
        arch,
        0,
        batches,
        layout,
        backend,
        inputs,
        patch,
        timeout=900,
    )
    for got in res:
        assert got["frames"][0] > 0 and got["frames"] == [got["frames"][0]] * len(batches), got[
            "frames"
        ]
        assert got["recompiles"] == 0
        assert got["breaks"] and all("torch.compiler.disable" in b for b in got["breaks"]), got[
            "breaks"
        ]
        for i, st in enumerate(got["steps"]):
            e, c = st["eager"], st["compiled"]
            assert c["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6), (
                i,
                c["loss"],
                e["loss"],
            )
            assert (c["logits"] is None) == (e["logits"] is None) == ("keep_logits" not in patch)
            if e["logits"] is not None:
                torch.testing.assert_close(c["logits"], e["logits"], **_TOL)
            assert set(c["grads"]) == set(e["grads"])
            for name, want in e["grads"].items():
                scale = max(1.0, want.abs().max().item())
                torch.testing.assert_close(
                    c["grads"][name],
                    want,
                    atol=2e-5 * scale,
                    rtol=1e-4,
                    msg=lambda m: f"step {i} grad {name}: {m}",
                )
    ref = build(arch, 0)
    with torch.no_grad():  # and eager is the unpatched model
        want = ref(batches[-1], labels=batches[-1]).loss.item()
    assert res[0]["steps"][-1]["eager"]["loss"] == pytest.approx(want, rel=1e-5)
