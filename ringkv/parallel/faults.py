"""Fault injection, for the tests that walk the unclean paths of a multi-rank engine.

``RINGKV_FAULT='{"rank": 1, "step": 3, "kind": "raise"}'`` in the environment makes rank 1
fail inside the 4th step it runs (``step`` counts from 0), half-way through its layers, so its
peers are inside the same step's collectives. Rank 0 is always the driver, the process that
built the ``LLM``: under torchrun (and on one process) it is also model rank 0; in spawn mode
it holds no model, so its fault fires right after it sent the step (the workers are inside
it), and the spawned model rank 0 gets none. Kinds:

- ``"raise"``: a ``RuntimeError``;
- ``"interrupt"``: a ``KeyboardInterrupt`` raised there (what a Ctrl-C that is not deferred does);
- ``"sigint"``: a real SIGINT sent to the process (a terminal's Ctrl-C);
- ``"kill"``: SIGKILL to the process (a crashed or killed rank);
- ``"drift"``: after that step, the rank's record of the running sequences is corrupted: a
  follower's step mirror (``plan.Mirror``) loses the last token of a sequence; the driver's
  ``plan.Publisher`` believes it sent one token more than it did. Either way the next step
  must fail with an ``EngineError`` naming it (raised by the rank whose mirror no longer fits).

It is read once when a rank's worker (or a driver) is built; spawned workers inherit the
environment. Without the variable nothing is installed and a step does no extra work.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Optional

KINDS = ("raise", "interrupt", "sigint", "kill", "drift")


def _spec() -> Optional[dict]:
    spec = os.environ.get("RINGKV_FAULT")
    if not spec:
        return None
    fault = json.loads(spec)
    if fault["kind"] not in KINDS:
        raise ValueError(f"RINGKV_FAULT kind must be one of {KINDS}, got {fault['kind']!r}")
    return fault


def _fire(fault: dict, where: str) -> None:
    kind = fault["kind"]
    if kind == "raise":
        raise RuntimeError(f"injected fault on {where} at step {fault['step']}")
    if kind == "interrupt":
        raise KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGINT if kind == "sigint" else signal.SIGKILL)


def install(worker) -> None:
    """Hook the fault the environment names (if it is this model rank's) into ``worker``'s model."""
    fault = _spec()
    if (
        fault is None
        or fault["rank"] != worker.mesh.rank
        or (fault["rank"] == 0 and not worker.driver)
    ):
        return
    if fault["kind"] == "drift":
        if worker.driver:
            return  # the driver's record: install_driver
        apply = worker.mirror.apply

        def corrupt(words):
            plan = apply(words)
            if worker.mirror.steps == fault["step"] + 1 and worker.mirror.seqs:
                next(iter(worker.mirror.seqs.values())).tokens.pop()
            return plan

        worker.mirror.apply = corrupt
        return
    layers = list(worker.model.model.layers.values())

    def fire(module, args):
        if worker.stats.steps == fault["step"]:  # steps counts the plans finished so far
            _fire(fault, f"rank {worker.mesh.rank}")

    layers[len(layers) // 2].register_forward_pre_hook(fire)


def install_driver(cluster) -> None:
    """A fault of rank 0 that its worker cannot carry: the driver's ``drift`` (its publisher),
    and in spawn mode every kind (the driver computes nothing: it fires after sending the step)."""
    fault = _spec()
    if fault is None or fault["rank"] != 0 or cluster.world == 1:
        return
    if fault["kind"] == "drift":
        pub = cluster.publisher
        encode = pub.encode

        def corrupt(*args):
            words = encode(*args)
            if pub.steps == fault["step"] + 1 and pub.sent:
                next(iter(pub.sent.values())).tokens += 1
                pub.tokens += 1
            return words

        pub.encode = corrupt
    elif cluster.worker is None:
        cluster.fault = lambda c: (
            _fire(fault, "the driver") if c.stats.steps == fault["step"] + 1 else None
        )
