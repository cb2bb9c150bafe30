"""Hosts on one machine: N network namespaces joined by a bridge, each link shaped with tbf.

``with Hosts(2, rate="1gbit") as h: h.run(0, ["python", ...])`` makes namespaces
``rkvh<pid>-0 .. -N-1`` whose only interface besides loopback is a veth ``rkvh<pid>h<i>`` with
address ``198.18.0.<i+1>/24`` (the benchmarking range, RFC 2544). The other end of every veth is
on a bridge inside one more namespace, ``rkvh<pid>-sw``: nothing is added to the machine's own
network namespace, the hosts have no default route, and no link leads outside them. Each veth
end has a ``tbf`` root qdisc at ``rate`` (both directions of a link are shaped).

Everything is torn down on exit (an exception and Ctrl-C included: the namespaces, with their
veths, bridge and processes, and their /etc/netns folders); leftovers of an earlier run whose
process is gone are removed at set-up. Needs CAP_NET_ADMIN: :func:`missing` says why not.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "rkvh"  # rkvh<pid>-<i>, rkvh<pid>-sw, veths rkvh<pid>h<i> / rkvh<pid>s<i>
SUBNET = "198.18.0"  # /24 inside 198.18.0.0/15
_OURS = re.compile(rf"^{PREFIX}(\d+)[-hsb]")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def missing() -> Optional[str]:
    """Why hosts cannot be made here (no CAP_NET_ADMIN, no ``ip``/``tc``), or ``None``."""
    try:
        with open("/proc/self/status") as f:
            cap = int(next(ln for ln in f if ln.startswith("CapEff:")).split()[1], 16)
    except (OSError, StopIteration, ValueError):
        cap = 0
    if not cap & (1 << 12):
        return "needs CAP_NET_ADMIN (run as root) to make network namespaces"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"needs the {tool!r} command (iproute2)"
    return None


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _kill_namespace(ns: str) -> None:
    """SIGKILL the processes in namespace ``ns`` (ours: only our hosts' commands run there)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove(ns: str) -> None:
    _kill_namespace(ns)
    _ip("netns", "del", ns, check=False)  # its veths (and so their peers) and the bridge go too
    d = f"/etc/netns/{ns}"
    if os.path.isdir(d):
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def clean_leftovers() -> List[str]:
    """Remove namespaces of earlier runs whose process is gone; returns their names."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = _OURS.match(ns)
        if m and not _alive(int(m.group(1))):
            _remove(ns)
            gone.append(ns)
    return gone


def _tbf(ns: str, dev: str, rate: str) -> None:
    """A tbf root qdisc at ``rate`` (tc's units: 100mbit, 1gbit): a 10 ms bucket (at least
    64 KiB, so a 10 Gbit/s link is not limited by the timer tick) and 50 ms of queue."""
    _ip("-n", ns, "link", "set", dev, "up")
    subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf"]
        + ["rate", rate, "burst", str(tbf_burst(rate)), "latency", "50ms"],
        check=True,
        capture_output=True,
        timeout=30,
    )


def tbf_burst(rate: str) -> int:
    """Bytes of ``_tbf``'s bucket at ``rate``: what a link idle for 10 ms passes at once."""
    return max(65536, _rate_bits(rate) // 8 // 100)


def _rate_bits(rate: str) -> int:
    """Bits/s of a tc rate (``ringkv.planner.parse_rate``'s units; tc needs the unit)."""
    from ringkv.planner import parse_rate

    if not re.search(r"(bit|bps)$", rate.strip().lower()):
        raise ValueError(f"rate {rate!r}: use tc's units, e.g. 100mbit, 1gbit, 10gbit")
    return int(8 * parse_rate(rate))


class Hosts:
    """``n`` hosts; ``rate`` shapes every link (``None``: unshaped). ``hostname_loopback``
    gives each host an /etc/hosts that maps this machine's hostname to ``127.0.1.1`` (Ubuntu's
    default, where gloo's own choice of address is loopback); else the hostname is left out."""

    def __init__(self, n: int, rate: Optional[str] = "1gbit", hostname_loopback: bool = True):
        if not 1 <= n <= 250:
            raise ValueError(f"Hosts: n={n}; make 1 to 250 hosts")
        if rate is not None:
            _rate_bits(rate)
        self.n, self.rate, self.hostname_loopback = n, rate, hostname_loopback
        self.tag = f"{PREFIX}{os.getpid()}"
        self.names = [f"{self.tag}-{i}" for i in range(n)]
        self.switch = f"{self.tag}-sw"
        self.procs: List[subprocess.Popen] = []

    def addr(self, i: int) -> str:
        """Host ``i``'s address."""
        return f"{SUBNET}.{i + 1}"

    def ifname(self, i: int) -> str:
        """Host ``i``'s interface (its end of the veth)."""
        return f"{self.tag}h{i}"

    def up(self) -> "Hosts":
        why = missing()
        if why:
            raise PermissionError(f"Hosts: {why}")
        clean_leftovers()
        atexit.register(self.down)  # an interpreter that exits without the fixture's teardown
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        sw, br = self.switch, f"{self.tag}b"
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", br, "type", "bridge")
        _ip("-n", sw, "link", "set", br, "up")
        hosts = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
        if self.hostname_loopback:
            hosts += f"127.0.1.1 {socket.gethostname()}\n"
        for i, ns in enumerate(self.names):
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts)
            _ip("netns", "add", ns)
            host_end, sw_end = self.ifname(i), f"{self.tag}s{i}"
            _ip("link", "add", host_end, "netns", ns, "type", "veth", "peer", "name", sw_end)
            _ip("link", "set", sw_end, "netns", sw)  # made here only for an instant
            _ip("-n", sw, "link", "set", sw_end, "master", br)
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", host_end)
            _ip("-n", ns, "link", "set", "lo", "up")
            for where, dev in ((ns, host_end), (sw, sw_end)):
                if self.rate is None:
                    _ip("-n", where, "link", "set", dev, "up")
                else:
                    _tbf(where, dev, self.rate)

    def down(self) -> None:
        """Stop our commands and remove every namespace (with its veths and bridge)."""
        atexit.unregister(self.down)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.names, self.switch]:
            _remove(ns)

    def __enter__(self) -> "Hosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def env(self, extra: Optional[dict] = None) -> dict:
        """The environment of a host's command: this one, the repository first on PYTHONPATH."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        env.update(extra or {})
        return env

    def run(
        self, i: int, cmd: Sequence[str], env: Optional[dict] = None, **popen
    ) -> subprocess.Popen:
        """Start ``cmd`` on host ``i`` (``"python"`` first means this venv's interpreter);
        stopped by :meth:`down` if still running."""
        cmd = [sys.executable if c == "python" and j == 0 else c for j, c in enumerate(cmd)]
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.names[i], *cmd], env=self.env(env), cwd=ROOT, **popen
        )
        self.procs.append(p)
        return p

    def link(self, i: int, up: bool) -> None:
        """Take host ``i``'s link down (both ends of its veth: packets in flight are lost, the
        host's sockets see nothing until their own timeouts) or bring it back up."""
        state = "up" if up else "down"
        _ip("-n", self.names[i], "link", "set", self.ifname(i), state)
        _ip("-n", self.switch, "link", "set", f"{self.tag}s{i}", state)

    def shape(self, rate: Optional[str], hosts: Optional[Sequence[int]] = None) -> None:
        """Re-shape the links of ``hosts`` (default all) to ``rate`` (``None``: unshaped), both
        directions, while the hosts run."""
        if rate is not None:
            _rate_bits(rate)
        for i in range(self.n) if hosts is None else hosts:
            for where, dev in ((self.names[i], self.ifname(i)), (self.switch, f"{self.tag}s{i}")):
                tc = ["ip", "netns", "exec", where, "tc", "qdisc"]
                subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True, timeout=30)
                if rate is not None:
                    _tbf(where, dev, rate)
        if hosts is None:
            self.rate = rate

    def kill(self, i: int) -> None:
        """SIGKILL every process on host ``i`` (a host that dies: its link stays up)."""
        _kill_namespace(self.names[i])

    def wait_reachable(self, i: int, j: int, port: int, timeout: float = 10.0) -> None:
        """Wait until host ``i`` connects to ``port`` on host ``j`` (something listening)."""
        code = (
            "import socket,sys,time\nt=time.time()+%r\nwhile True:\n try:\n"
            "  socket.create_connection((%r,%d),1).close();break\n except OSError:\n"
            "  time.sleep(0.1)\n  if time.time()>t: sys.exit(1)\n"
        ) % (timeout, self.addr(j), port)
        p = self.run(i, ["python", "-c", code])
        if p.wait(timeout + 5):
            raise TimeoutError(f"host {i} cannot reach {self.addr(j)}:{port}")


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> List[int]:
    """Exit codes of ``procs``; kills what is still running after ``timeout`` seconds (-9)."""
    end = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes
