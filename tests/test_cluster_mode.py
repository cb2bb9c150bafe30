"""``Cluster.mode`` is a ``ClusterMode``: every state named, equal to the strings it was."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from ringkv.engine import LLM  # noqa: E402
from ringkv.parallel.launch import Cluster, ClusterMode  # noqa: E402
from tests.models import tiny_model  # noqa: E402


def test_modes_are_the_old_strings():
    assert [m.value for m in ClusterMode] == ["local", "torchrun", "spawn", "closed"]
    for m in ClusterMode:
        assert m == m.value and str(m) == m.value and f"{m}" == m.value
        assert ClusterMode(m.value) is m


def test_mode_for(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Cluster.mode_for(1) is ClusterMode.LOCAL
    assert Cluster.mode_for(2) is ClusterMode.SPAWN
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Cluster.mode_for(2) is ClusterMode.TORCHRUN
    with pytest.raises(ValueError, match="torchrun started 2 processes; use --nproc-per-node 4"):
        Cluster.mode_for(4)


def test_a_local_cluster_keeps_its_mode_when_closed():
    """(A spawn driver's ``CLOSED`` after ``close()``: ``tests/test_launch.py``, which already
    pays for spawning workers.)"""
    with LLM(tiny_model("llama", 0, num_hidden_layers=2), block_size=4, num_blocks=16) as llm:
        assert llm.core.cluster.mode is ClusterMode.LOCAL
    assert llm.core.cluster.mode is ClusterMode.LOCAL
