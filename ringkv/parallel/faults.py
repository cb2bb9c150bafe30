"""Fault injection, for the tests that walk the unclean paths of a multi-rank engine.

``RINGKV_FAULT='{"rank": 1, "step": 3, "kind": "raise"}'`` in the environment makes global
rank 1 fail inside the 4th step plan it runs (``step`` counts from 0), half-way through its
layers, so its peers are inside the same step's collectives. Kinds:

- ``"raise"``: a ``RuntimeError``;
- ``"interrupt"``: a ``KeyboardInterrupt`` raised there (what a Ctrl-C that is not deferred does);
- ``"sigint"``: a real SIGINT sent to the process (a terminal's Ctrl-C);
- ``"kill"``: SIGKILL to the process (a crashed or killed rank);
- ``"drift"``: after that step, the rank's record of the running sequences is corrupted: a
  follower's step mirror (``plan.Mirror``) loses the last token of a sequence; the driver's
  ``plan.Publisher`` believes it sent one token more than it did. Either way the next step
  must fail with an ``EngineError`` naming it (raised by the rank whose mirror no longer fits).

It is read once when a rank's worker is built; spawned workers inherit the environment.
Without the variable nothing is installed and a step does no extra work.
"""

from __future__ import annotations

import json
import os
import signal

KINDS = ("raise", "interrupt", "sigint", "kill", "drift")


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
    if fault["kind"] == "drift":
        record = worker.publisher if worker.mesh.rank == 0 else worker.mirror
        update = record.encode if worker.mesh.rank == 0 else record.apply

        def corrupt(*args):
            out = update(*args)
            if record.steps == fault["step"] + 1:
                if worker.mesh.rank == 0 and record.sent:
                    next(iter(record.sent.values())).tokens += 1
                    record.tokens += 1
                elif worker.mesh.rank != 0 and record.seqs:
                    next(iter(record.seqs.values())).tokens.pop()
            return out

        setattr(record, "encode" if worker.mesh.rank == 0 else "apply", corrupt)
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
