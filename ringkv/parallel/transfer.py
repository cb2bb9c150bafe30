"""Point-to-point transfer of a byte string (a serialised ``KVSnapshot``) between two ranks of
a ``torch.distributed`` group: its length, then its bytes, as two messages. Waits are bounded
on gloo; on NCCL the bytes travel as a CUDA tensor. ``dst``/``src`` are global ranks."""

from __future__ import annotations

import ctypes
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..sp.collectives import wait

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
        wait(dist.isend(t, dst, group=group, tag=TAG), t, timeout, f"sending a snapshot to rank {dst}")


def recv_bytes(src: int, group=None, timeout: Optional[timedelta] = None) -> bytes:
    dev = _device(group)
    n = torch.empty(1, dtype=torch.int64, device=dev)
    wait(dist.irecv(n, src, group=group, tag=TAG), n, timeout, f"a snapshot from rank {src}")
    payload = torch.empty(int(n), dtype=torch.uint8, device=dev)
    wait(dist.irecv(payload, src, group=group, tag=TAG), payload, timeout, f"a snapshot from rank {src}")
    payload = payload.cpu().contiguous()
    return ctypes.string_at(payload.data_ptr(), payload.numel())  # one C copy (bytes(storage) loops in Python)
