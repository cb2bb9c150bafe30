"""The other process of ``tests/test_remote.py``: connects to the test's link and plays one part.

    python tests/remote_peer.py ROLE MODEL_DIR PORT CONFIG_JSON

``target``: receive ``CONFIG["requests"]`` requests, finish them, send back their token ids
and whether all blocks are free; ``CONFIG["die"] == "after-precopy-ack"`` kills itself
(SIGKILL) right after acknowledging the first pre-copy. ``source``: add ``CONFIG["prompts"]``
with ``CONFIG["params"]``, step ``CONFIG["steps"]`` times, move each request (the first
transfer damaged in one byte if ``CONFIG["damage_first"]``: its move fails, then it is sent
again); ``CONFIG["die"] == "after-final-ack"`` kills itself once the last request moved.
``silent``: connect to every port in ``CONFIG["ports"]`` and say nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.engine.remote import MigrationError, receive_request, send_request  # noqa: E402
from ringkv.parallel.transfer import Link  # noqa: E402

TIMEOUT = timedelta(seconds=60)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def finish(llm: LLM) -> dict:
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o.token_ids
    return outs


def target(llm: LLM, link: Link, cfg: dict) -> None:
    if cfg.get("die") == "after-precopy-ack":
        send_json = link.send_json

        def ack_then_die(obj):
            send_json(obj)
            if obj.get("ok"):
                die()

        link.send_json = ack_then_die
    errors = []
    for _ in range(cfg["requests"]):
        try:
            receive_request(llm, link)
        except MigrationError as e:
            errors.append(str(e))
    outs = finish(llm)
    link.send_json(
        dict(
            outputs=outs,
            errors=errors,
            all_free=llm.core.blocks.num_free == llm.core.blocks.num_blocks
            and not llm.core.pipeline.staged,
        )
    )


def damage_once(link: Link) -> None:
    """Flip one bit of the first tensor chunk of the next message this link sends."""
    stream = link._stream

    def damaged(op, chunks, what, done=None):
        def flip(chunks):
            for i, c in enumerate(chunks):
                if i == 2:  # after the header's length and JSON
                    c = c.clone()
                    c[0] ^= 1
                yield c

        link._stream = stream
        return stream(op, flip(chunks), what, done)

    link._stream = damaged


def source(llm: LLM, link: Link, cfg: dict) -> None:
    rids = [
        llm.add_request(p, SamplingParams(**cfg["params"]), request_id=f"r{i}")
        for i, p in enumerate(cfg["prompts"])
    ]
    for _ in range(cfg["steps"]):
        llm.step()
    if cfg.get("damage_first"):
        damage_once(link)
        try:
            send_request(llm, rids[0], link, incremental=False)
        except MigrationError as e:
            print("first move failed:", e, flush=True)
        else:
            raise AssertionError("a damaged transfer was accepted")
    for rid in rids:
        send_request(llm, rid, link, incremental=cfg.get("incremental", True))
    if cfg.get("die") == "after-final-ack":
        die()
    link.send_json(
        dict(outputs=finish(llm), all_free=llm.core.blocks.num_free == llm.core.blocks.num_blocks)
    )


def main() -> None:
    role, model_dir, port, cfg = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    torch.set_num_threads(1)
    if role == "silent":
        links = [Link.connect("127.0.0.1", p, TIMEOUT) for p in [port] + cfg.get("ports", [])]
        time.sleep(600)  # until the test kills it
        for link in links:
            link.close()
        return
    llm = LLM(model_dir, **cfg["engine"])
    link = Link.connect("127.0.0.1", port, TIMEOUT)
    (target if role == "target" else source)(llm, link, cfg)
    link.close()
    llm.close()


if __name__ == "__main__":
    main()
    # done and closed: end now, not after the interpreter's teardown of torch (1-2 s more, which
    # the test waits for in ``peer.wait()``)
    sys.stdout.flush()
    os._exit(0)
