"""Moving a running request to an engine in another process, on this host or another, over a
``parallel.transfer.Link`` (the engine side of the protocol; the link does the communication).

The source (``send_request``) sends a pre-copy snapshot while the request keeps its place in
its scheduler (``incremental=True``), then stops it and sends what is new since (the final
snapshot); the target (``receive_request``) imports each and answers ``{"ok": true}`` or
``{"ok": false, "error": ...}``. The request belongs to the target once it has sent the final
``ok``: the source then frees its copy. Before that, any failure (the target refused a
snapshot, a damaged transfer, a timeout, either side died) leaves it with the source, which
resumes it, and the target drops what it staged: nothing is lost. One window is left: if the
link fails after the target sent its final ``ok`` but before the source read it, both run the
request (it is duplicated, never lost). Requests move one after another over one link.
"""

from __future__ import annotations

import time
from dataclasses import fields

import torch

from ..parallel.transfer import Link, LinkError
from .snapshot import KVSnapshot, PrefixKV


class MigrationError(RuntimeError):
    """A request did not move; it is where it was (running on the source)."""


def _send(link: Link, kind: str, obj, what: str) -> int:
    """A dataclass ``obj`` over ``link`` under head key ``kind``: its fields as the head, its
    tensors in place (the link checksums both); the bytes sent."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    return link.send({kind: {k: v for k, v in values.items() if k not in tensors}}, tensors, what)


def _recv(link: Link, kind: str, cls, what: str):
    """The next message: a ``cls`` sent by ``_send`` under ``kind``, or the peer's JSON value
    (``send_json``) as a dict ``{"json": value}``. A message missing a field is a
    ``ValueError`` (the link stays in step)."""
    head, tensors = link.recv(what)
    if "json" in head:
        return head
    meta = head.get(kind)
    if not isinstance(meta, dict):
        raise ValueError(f"{link}: the peer sent neither a {kind} nor a JSON message")
    known = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in meta.items() if k in known and k not in tensors}, **tensors)
    except TypeError as e:
        raise ValueError(f"{link}: the peer sent an incomplete {kind}: {e}") from None


def send_snapshot(link: Link, snap: KVSnapshot) -> int:
    """A snapshot over ``link``: its fields as the head, its tensors in place; the bytes sent."""
    return _send(link, "snapshot", snap, f"sending a snapshot of request {snap.request_id!r}")


def recv_snapshot(link: Link, what: str = "a snapshot"):
    """The next message: a ``KVSnapshot``, or the peer's JSON value (``send_json``) as a dict
    ``{"json": value}``. A snapshot missing a field is a ``ValueError``."""
    return _recv(link, "snapshot", KVSnapshot, what)


def send_prefix(link: Link, prefix: PrefixKV) -> int:
    """A cached prefix (``LLM.export_prefix``) over ``link``; the bytes sent. The peer reads it
    with ``recv_prefix``."""
    return _send(link, "prefix", prefix, "sending a cached prefix")


def recv_prefix(link: Link, what: str = "a cached prefix") -> PrefixKV:
    """The ``PrefixKV`` the peer sent with ``send_prefix``. ``MigrationError`` if it sent an
    error instead (``{"ok": false, "error": ...}``: it holds none, or failed), ``ValueError`` if
    the message is not a complete prefix (damaged: the link stays in step)."""
    got = _recv(link, "prefix", PrefixKV, what)
    if isinstance(got, dict):
        reply = got["json"]
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise MigrationError(f"{link}: the peer sent no prefix: {error}")
    return got


def send_request(llm, request_id, link: Link, *, incremental: bool = True, between=None) -> dict:
    """Move ``request_id`` from ``llm`` to the engine behind ``link`` (which runs
    ``receive_request``). Returns ``request_id``, ``bytes`` (sent), ``final_bytes`` (sent while
    the request was stopped), ``seconds``, ``downtime_s`` (from stopping it here to the
    target's final ``ok``) and ``stopped_at`` (``time.time()`` of the stop). ``between()``: called
    after the pre-copy is acknowledged and before the stop (the caller keeps stepping the engine
    there; the final snapshot then holds what it computed). On failure raises
    ``MigrationError``; the request runs here again."""
    t0 = time.monotonic()
    stopped, staged, sent = None, False, 0  # stopped: when the final export stopped it here
    try:
        base = None
        if incremental:
            base = llm.export_request(request_id, stop=False)
            sent += send_snapshot(link, base)
            _ack(link, "the pre-copy")
            staged = True
            if between is not None:
                between()
        final = llm.export_request(request_id, since=base, stop=True)
        stopped, stopped_at = time.monotonic(), time.time()
        final_bytes = send_snapshot(link, final)
        sent += final_bytes
        staged = False  # the target drops a refused final itself
        _ack(link, "the final snapshot")
    except BaseException as e:
        if stopped is not None:
            llm.resume_request(request_id)
        if (
            staged and link.broken is None
        ):  # failed here between the pre-copy and the final: tell the target
            try:
                link.send_json({"ok": False, "error": f"the source gave up: {e}"})
            except LinkError:
                pass
        if not isinstance(e, Exception):
            raise
        resumed = "" if stopped is None else " (it runs here again)"
        raise MigrationError(f"request {request_id!r} did not move{resumed}: {e}") from e
    llm.abort_request(request_id)  # the target has it: free the blocks here
    end = time.monotonic()
    return dict(
        request_id=request_id,
        bytes=sent,
        final_bytes=final_bytes,
        seconds=end - t0,
        downtime_s=end - stopped,
        stopped_at=stopped_at,
    )


def _ack(link: Link, what: str) -> None:
    reply = link.recv_json(f"the target's answer to {what}")
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise MigrationError(f"the target refused {what}: {error}")


def receive_request(llm, link: Link, *, cache_prefix: bool = False):
    """Import the next request ``send_request`` sends over ``link`` into ``llm``; returns its id
    once the final snapshot is imported and acknowledged (the request then runs here). If the
    transfer fails first (a refused or damaged snapshot, the source gave up or died) the staged
    import is dropped (its blocks freed) and ``MigrationError`` is raised. ``cache_prefix``: as
    for ``import_request`` (you trust the source)."""
    rid = None  # the request staged here
    try:
        while True:
            try:
                snap = recv_snapshot(link, "a snapshot from the source")
            except ValueError as e:  # damaged in transit: the link is still in step
                _refuse(link, e)
                raise
            if not isinstance(snap, KVSnapshot):  # the source gave up
                error = (
                    snap["json"].get("error") if isinstance(snap["json"], dict) else snap["json"]
                )
                raise MigrationError(f"request {rid!r} was not received: {error}")
            try:
                if rid is not None and snap.request_id != rid:
                    raise ValueError(
                        f"a snapshot of request {snap.request_id!r} came before the final one "
                        f"of {rid!r}"
                    )
                rid = llm.import_request(snap, cache_prefix=cache_prefix)
            except (
                Exception
            ) as e:  # refused (ValueError), or the engine failed: the source keeps it
                _refuse(link, e)
                raise
            link.send_json({"ok": True})
            if snap.final:
                return rid
            del (
                snap
            )  # a pre-copy's K/V are in the cache now: free them before the final snapshot comes
    except BaseException as e:
        if rid is not None:
            llm.abort_request(rid)  # staged, or started but not acknowledged: the source keeps it
        if not isinstance(e, Exception) or isinstance(e, MigrationError):
            raise
        raise MigrationError(
            f"{'no request' if rid is None else f'request {rid!r}'} was not received: {e}"
        ) from e


def _refuse(link: Link, e: Exception) -> None:
    link.send_json({"ok": False, "error": f"{type(e).__name__}: {e}"})
