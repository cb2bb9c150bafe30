"""Moving ``KVSnapshot``s between processes.

``send_bytes`` / ``recv_bytes``: a byte string (a serialised snapshot) between two ranks of a
``torch.distributed`` group: its length, then its bytes, as two messages. Waits are bounded on
gloo; on NCCL the bytes travel as a CUDA tensor. ``dst``/``src`` are global ranks.

``Link``: two processes that share no process group (two engines on different hosts, each
spawned or a torchrun driver) pair up by a TCP rendezvous and exchange messages: a JSON head
and named tensors, in chunks, without a copy on either side (``engine/remote.py`` sends
``KVSnapshot``s this way)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import socket
import time
from collections import deque
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..sp.collectives import wait
from ..sp.comm import RingTimeoutError

TAG = 13  # apart from the engine's own messages


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_bytes(data: bytes, dst: int, group=None, timeout: Optional[timedelta] = None) -> None:
    dev = _device(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    for t in (n, payload):
        wait(
            dist.isend(t, dst, group=group, tag=TAG),
            t,
            timeout,
            f"sending a snapshot to rank {dst}",
        )


def recv_bytes(src: int, group=None, timeout: Optional[timedelta] = None) -> bytes:
    dev = _device(group)
    n = torch.empty(1, dtype=torch.int64, device=dev)
    wait(dist.irecv(n, src, group=group, tag=TAG), n, timeout, f"a snapshot from rank {src}")
    payload = torch.empty(int(n), dtype=torch.uint8, device=dev)
    wait(
        dist.irecv(payload, src, group=group, tag=TAG),
        payload,
        timeout,
        f"a snapshot from rank {src}",
    )
    payload = payload.cpu().contiguous()
    return ctypes.string_at(
        payload.data_ptr(), payload.numel()
    )  # one C copy (bytes(storage) loops in Python)


# -- a link between two processes that share no process group --------------------------------
CHUNK_BYTES = 4 << 20  # default chunk of a tensor on the wire
WINDOW = 2  # chunks posted ahead of the one waited for
LINK_TAG = 0  # a link's group carries nothing else


class LinkError(RingTimeoutError):
    """A link failed: its peer closed it (died), broke the protocol, or the link was closed.
    The link is unusable afterwards (``Link.broken`` says why)."""


class LinkTimeout(LinkError, TimeoutError):
    """A link's peer, alive or not, did not answer within the link's timeout."""


class Link:
    """A pairwise gloo group between two processes, made by a TCP rendezvous: no default
    process group, no shared file system, no global state (a process may hold many links).

    ``Link.listen(host, port)`` (rank 0) starts a ``TCPStore`` there (``port=0``: a free one,
    read ``.port``); the peer calls ``Link.connect(host, port)`` (rank 1); the listener's group
    is built by ``accept()``, or by its first message. Messages go in order, each side taking turns
    as its protocol says: ``send``/``recv`` (a JSON head, then each tensor's bytes in
    ``chunk_bytes`` chunks, then a SHA-256 over both) and ``send_json``/``recv_json``. Every wait is
    bounded by
    ``timeout``: a dead peer is a ``LinkError`` as soon as gloo sees the closed connection, a
    silent one a ``LinkTimeout`` after ``timeout``; either closes the link. A damaged message
    (checksum) is a ``ValueError`` and leaves the link usable."""

    def __init__(self, store, rank: int, host: str, device, timeout: timedelta, chunk_bytes: int):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.rank, self.host, self.port = rank, host, store.port
        self.timeout, self.chunk_bytes = timeout, chunk_bytes
        self.broken: Optional[str] = None  # why the link is unusable
        self._store, self._device, self._group = store, device, None

    @classmethod
    def listen(
        cls,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: timedelta = timedelta(seconds=60),
        chunk_bytes: int = CHUNK_BYTES,
    ) -> "Link":
        """Rank 0: listen on ``host:port`` for one peer; returns at once (``accept`` waits)."""
        store = dist.TCPStore(host, port, 2, True, timeout=timeout, wait_for_workers=False)
        gloo = dist.ProcessGroupGloo
        device = (
            gloo.create_default_device()
            if host in ("", "0.0.0.0", "::")
            else gloo.create_device(hostname=host)
        )
        return cls(store, 0, host, device, timeout, chunk_bytes)

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        timeout: timedelta = timedelta(seconds=60),
        chunk_bytes: int = CHUNK_BYTES,
    ) -> "Link":
        """Rank 1: connect to a listening link (retried until ``timeout``)."""
        try:
            store = dist.TCPStore(host, port, 2, False, timeout=timeout)
        except RuntimeError as e:
            raise LinkTimeout(
                f"no link listens on {host}:{port} (waited {timeout.total_seconds():.0f}s): {e}"
            ) from e
        device = dist.ProcessGroupGloo.create_device(hostname=_local_address(host, port))
        link = cls(store, 1, host, device, timeout, chunk_bytes)
        link.accept()
        return link

    def __repr__(self) -> str:
        return f"Link(rank {self.rank}, {self.host}:{self.port})"

    def accept(self, timeout: Optional[timedelta] = None) -> "Link":
        """Build the group: the listener waits for its peer at most ``timeout`` (default: the
        link's; a peer still starting up may need longer than a message does)."""
        if self._group is None:
            self._check()
            timeout = timeout or self.timeout
            self._store.set_timeout(timeout)
            opts = (
                dist.ProcessGroupGloo._Options()
            )  # as torch.distributed builds its gloo groups: to pick the device
            opts._timeout, opts._devices = timeout, [self._device]
            try:
                self._group = dist.ProcessGroupGloo(
                    dist.PrefixStore("link", self._store), self.rank, 2, opts
                )
            except RuntimeError as e:
                self._fail(
                    LinkTimeout, f"{self}: no peer joined within {timeout.total_seconds():g}s: {e}"
                )
        return self

    def close(self) -> None:
        """Close the connection (the peer's next wait fails at once) and the listener's store."""
        self.broken = self.broken or "the link was closed"
        self._group = self._store = None

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- messages --------------------------------------------------------------------------
    def send(
        self, head: dict, tensors: Optional[Dict[str, torch.Tensor]] = None, what: str = "sending"
    ) -> int:
        """A message: ``head`` (JSON) and named tensors (read in place: a tensor whose rows are
        contiguous, such as K/V taken as ``(layers, 2, ...)[:, i]``, is not copied; fp8
        included). Returns the bytes sent."""
        return self._send(head, tensors or {}, what)

    def recv(self, what: str = "the next message") -> Tuple[dict, Dict[str, torch.Tensor]]:
        """The next message: ``(head, tensors)``, each tensor received in place into its own
        buffer. ``what``: what a timeout says it waited for."""
        head, tensors = self._recv(what)
        head.pop("tensors"), head.pop("chunk")
        return head, tensors

    def send_json(self, obj) -> None:
        self._send({"json": obj}, {}, "sending a JSON message")

    def recv_json(self, what: str = "a JSON message"):
        head, tensors = self.recv(what)
        if set(head) != {"json"} or tensors:
            self._fail(
                LinkError, f"{self}: expected a JSON message, the peer sent {sorted(head)!r:.200}"
            )
        return head["json"]

    # -- the wire: head (length, JSON), each tensor's chunks, SHA-256 of all ---------------------
    def _send(self, head: dict, tensors: Dict[str, torch.Tensor], what: str) -> int:
        pieces = {name: _pieces(t) for name, t in tensors.items()}
        layout = [
            [name, str(t.dtype).replace("torch.", ""), list(t.shape), len(pieces[name])]
            for name, t in tensors.items()
        ]
        head = dict(head, tensors=layout, chunk=self.chunk_bytes)
        data = json.dumps(head).encode()
        digest = hashlib.sha256(data)

        def chunks():
            yield torch.tensor([len(data)], dtype=torch.int64)
            yield torch.frombuffer(bytearray(data), dtype=torch.uint8)
            for parts in pieces.values():
                for p in parts:
                    for i in range(0, p.numel(), self.chunk_bytes):
                        c = p[i : i + self.chunk_bytes]
                        digest.update(c.numpy())
                        yield c
            yield torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)

        self._stream("send", chunks(), what)
        return len(data) + sum(t.numel() * t.element_size() for t in tensors.values())

    def _recv(self, what: str):
        n = torch.empty(1, dtype=torch.int64)
        self._stream("recv", [n], what)
        if not 0 < int(n) < 1 << 30:
            self._fail(
                LinkError,
                f"{self}: the peer sent a message header of {int(n)} bytes: not a ringkv link",
            )
        data = torch.empty(int(n), dtype=torch.uint8)
        self._stream("recv", [data], f"{what} (its header)")
        data = data.numpy().tobytes()
        try:
            head = json.loads(data)
            layout = [
                (name, _dtype(dtype), [int(s) for s in shape], int(parts))
                for name, dtype, shape, parts in head["tensors"]
            ]
            chunk = int(head["chunk"])
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ) as e:  # out of step with the peer from here
            self._fail(
                LinkError,
                f"{self}: the peer sent a damaged message header ({type(e).__name__}: {e})",
            )
        tensors, bufs = {}, []
        for name, dtype, shape, parts in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            if min(shape, default=0) < 0 or parts < 1 or nbytes % parts or chunk < 1:
                self._fail(
                    LinkError,
                    f"{self}: the peer sent a damaged message header ({name}: {shape}, {parts} "
                    "parts)",
                )
            buf = torch.empty(
                nbytes, dtype=torch.uint8
            )  # each tensor once; its chunks land in slices of it
            tensors[name] = buf.view(dtype).view(shape)
            size = (
                nbytes // parts
            )  # the sender's pieces (a layer each when not contiguous), chunked alike
            bufs += [
                buf[p + i : p + min(i + chunk, size)]
                for p in range(0, nbytes, size or 1)
                for i in range(0, size, chunk)
            ]
        digest = hashlib.sha256(data)
        got = torch.empty(32, dtype=torch.uint8)
        self._stream("recv", bufs, f"{what} (its tensors)", lambda c: digest.update(c.numpy()))
        self._stream("recv", [got], f"{what} (its checksum)")
        if got.numpy().tobytes() != digest.digest():
            raise ValueError(
                f"{self}: a message arrived damaged: its bytes do not match their checksum"
            )
        return head, tensors

    def _stream(self, op: str, chunks, what: str, done=None) -> None:
        """``op`` ("send"/"recv") of each chunk, ``WINDOW`` posted ahead; ``done(chunk)`` in
        order."""
        group = self.accept()._group
        pending = deque()
        for c in chunks:
            try:
                work = (group.send if op == "send" else group.recv)([c], 1 - self.rank, LINK_TAG)
            except RuntimeError as e:
                self._fail(LinkError, f"{self}: {what}: {e}")
            pending.append((work, c))
            while len(pending) > WINDOW:
                self._wait(*pending.popleft(), what, done)
        while pending:
            self._wait(*pending.popleft(), what, done)

    def _wait(self, work, c: torch.Tensor, what: str, done) -> None:
        t0 = time.monotonic()
        try:
            wait(work, c, self.timeout, f"{self}: {what}")
        except RingTimeoutError as e:
            slow = time.monotonic() - t0 >= 0.99 * self.timeout.total_seconds()
            why = (
                f"no answer within {self.timeout.total_seconds():g}s"
                if slow
                else "the peer closed the link (died?)"
            )
            self._fail(LinkTimeout if slow else LinkError, f"{self}: {what}: {why}: {e.__cause__}")
        if done is not None:
            done(c)

    def _check(self) -> None:
        if self.broken is not None:
            raise LinkError(f"the link is unusable: {self.broken}")

    def _fail(self, error, message: str):
        self.close()
        self.broken = message
        raise error(message)


def _pieces(t: torch.Tensor) -> List[torch.Tensor]:
    """``t``'s bytes in C order as flat uint8 views of equal size, without a copy when ``t`` or
    each ``t[i]`` is contiguous (export's K/V are ``(layers, 2, ...)[:, i]``)."""
    if not t.is_contiguous() and t.dim() > 1 and t.shape[0] > 0 and t[0].is_contiguous():
        return [x.reshape(-1).view(torch.uint8) for x in t]
    return [t.contiguous().reshape(-1).view(torch.uint8)]


def _dtype(name) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the peer can reach us at)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)  # UDP: picks the route, sends nothing
        return s.getsockname()[0]
