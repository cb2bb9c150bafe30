"""The socket interface of a world that spans hosts.

gloo (and NCCL's socket bootstrap) advertise the address the machine's hostname resolves to
unless ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``) names an interface. Where /etc/hosts maps
the hostname to loopback (Ubuntu's ``127.0.1.1`` line), every rank of a multi-host world then
dies in gloo's ``connectFullMesh ... Connection refused, remote=[127.0.0.1]``, which names neither
the cause nor the fix. :func:`pick_interface` names the interface whose address routes to the
master before any process group is made, or fails at once with an error that says why.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import Dict, MutableMapping, Optional

__all__ = ["InterfaceError", "interface_addresses", "pick_interface", "route_source"]

VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_FIX = (
    "name the interface that reaches the other hosts with GLOO_SOCKET_IFNAME (and "
    "NCCL_SOCKET_IFNAME), or give torchrun a master address the other hosts reach "
    "(--master-addr HOST0_IP; with --rdzv-backend c10d also --local-addr THIS_HOST_IP on every "
    "node, since the workers' MASTER_ADDR is then node 0's hostname)"
)


class InterfaceError(RuntimeError):
    """No interface of this host reaches the master of a world that spans hosts."""


def interface_addresses() -> Dict[str, list]:
    """``{interface name: [its IPv4 and IPv6 addresses]}`` of this host (network namespace)."""
    out: Dict[str, list] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address
                continue
            out.setdefault(name, []).append(addr)
    try:
        with open("/proc/net/if_inet6") as f:  # hex address, index, prefix, scope, flags, name
            for line in f:
                hexaddr, *_, name = line.split()
                addr = str(ipaddress.IPv6Address(bytes.fromhex(hexaddr)))
                out.setdefault(name, []).append(addr)
    except OSError:  # no IPv6
        pass
    return out


def route_source(host: str, port: int = 29500) -> str:
    """The local address this host sends from to reach ``host`` (a name or an address): a UDP
    socket ``connect()``ed to it sends nothing, the kernel only chooses the route. Raises
    ``InterfaceError`` when ``host`` does not resolve or no route reaches it."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise InterfaceError(f"the master address {host!r} does not resolve ({e}); {_FIX}") from e
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as e:
            raise InterfaceError(
                f"no route from this host to the master address {host!r} ({sockaddr[0]}): {e}; "
                f"{_FIX}"
            ) from e
        return s.getsockname()[0]


def pick_interface(
    master: Optional[str] = None, env: Optional[MutableMapping[str, str]] = None
) -> Optional[str]:
    """Name the socket interface for gloo and NCCL's bootstrap when the world spans hosts.

    Call it before the process group is made. ``master`` is the master's host (default
    ``MASTER_ADDR``, which torchrun sets for both rendezvous forms); ``env`` defaults to
    ``os.environ`` and is where ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` if unset) are
    written. Returns the interface gloo will use, or ``None`` where nothing is changed: a variable
    the user set wins, and a world on one host (``WORLD_SIZE <= LOCAL_WORLD_SIZE``, or no
    torchrun variables) keeps gloo's default. Raises ``InterfaceError`` at once, naming the
    cause and the variables, when the master address is loopback here although the world spans
    hosts (the hostname mapped to ``127.0.1.1``), does not resolve, or no interface holds the
    address that routes to it."""
    env = os.environ if env is None else env
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError:
        return None
    host = master or env.get("MASTER_ADDR")
    if world <= local or not host:
        return None  # one host: exactly as gloo has always done
    source = route_source(host, int(env.get("MASTER_PORT", "29500") or 29500))
    target = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0][4][0]
    if ipaddress.ip_address(target).is_loopback or ipaddress.ip_address(source).is_loopback:
        raise InterfaceError(
            f"the master address {host!r} is {target} on this host, a loopback address, but the "
            f"world spans hosts (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}): the other hosts "
            "cannot reach it and gloo would advertise 127.0.0.1 (the usual cause: /etc/hosts "
            f"maps the hostname to 127.0.1.1); {_FIX}"
        )
    names = [n for n, addrs in interface_addresses().items() if source in addrs]
    if not names:
        raise InterfaceError(
            f"this host reaches the master address {host!r} from {source}, but no interface "
            f"holds that address; {_FIX}"
        )
    env["GLOO_SOCKET_IFNAME"] = names[0]
    env.setdefault("NCCL_SOCKET_IFNAME", names[0])
    return names[0]
