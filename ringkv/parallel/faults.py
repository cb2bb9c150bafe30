"""Fault injection, for the tests that walk the unclean paths of a multi-rank engine.

``RINGKV_FAULT='{"rank": 1, "step": 3, "kind": "raise"}'`` in the environment makes global
rank 1 fail inside the 4th step plan it runs (``step`` counts from 0), half-way through its
layers, so its peers are inside the same step's collectives. Kinds:

- ``"raise"``: a ``RuntimeError``;
- ``"interrupt"``: a ``KeyboardInterrupt`` raised there (what a Ctrl-C that is not deferred does);
- ``"sigint"``: a real SIGINT sent to the process (a terminal's Ctrl-C);
- ``"kill"``: SIGKILL to the process (a crashed or killed rank).

It is read once when a rank's worker is built; spawned workers inherit the environment.
Without the variable nothing is installed and a step does no extra work.
"""

from __future__ import annotations

import json
import os
import signal

KINDS = ("raise", "interrupt", "sigint", "kill")


def install(worker) -> None:
    """Hook the fault the environment names (if it is this rank's) into ``worker``'s model."""
    spec = os.environ.get("RINGKV_FAULT")
    if not spec:
        return
    fault = json.loads(spec)
    if fault["kind"] not in KINDS:
        raise ValueError(f"RINGKV_FAULT kind must be one of {KINDS}, got {fault['kind']!r}")
    if fault["rank"] != worker.mesh.rank:
        return
    layers = list(worker.model.model.layers.values())

    def fire(module, args):
        if worker.stats.steps != fault["step"]:  # steps counts the plans finished so far
            return
        kind = fault["kind"]
        if kind == "raise":
            raise RuntimeError(f"injected fault on rank {worker.mesh.rank} at step {fault['step']}")
        if kind == "interrupt":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT if kind == "sigint" else signal.SIGKILL)

    layers[len(layers) // 2].register_forward_pre_hook(fire)
