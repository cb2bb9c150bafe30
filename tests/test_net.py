"""ringkv.parallel.net on this host: when it leaves gloo alone, what it picks, how it fails
(tests/test_hosts.py runs it across real hosts)."""

from __future__ import annotations

import socket
import time

import pytest

from ringkv.parallel import net

SPANS = dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_PORT="29500")


def test_one_host_and_a_users_variable_are_left_alone():
    for env in (
        dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"),  # torchrun, one host
        dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", MASTER_ADDR=socket.gethostname()),
        {},  # no torchrun
        dict(SPANS),  # no master address: nothing to route to
    ):
        before = dict(env)
        assert net.pick_interface(env=env) is None
        assert env == before
    env = dict(SPANS, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="mine")
    assert net.pick_interface(env=env) == "mine"
    assert "NCCL_SOCKET_IFNAME" not in env


def test_a_loopback_master_across_hosts_fails_at_once_naming_the_variables():
    for master in ("127.0.0.1", "localhost"):
        env = dict(SPANS, MASTER_ADDR=master)
        t = time.monotonic()
        with pytest.raises(net.InterfaceError, match="loopback") as e:
            net.pick_interface(env=env)
        assert time.monotonic() - t < 5
        assert "GLOO_SOCKET_IFNAME" in str(e.value) and "NCCL_SOCKET_IFNAME" in str(e.value)
        assert "GLOO_SOCKET_IFNAME" not in env


def test_an_address_of_this_host_picks_its_interface():
    addrs = net.interface_addresses()
    assert "127.0.0.1" in addrs.get("lo", [])
    own = [(n, a) for n, al in addrs.items() for a in al if ":" not in a and n != "lo"]
    if not own:
        pytest.skip("no IPv4 interface besides loopback")
    name, addr = own[0]
    assert net.route_source(addr) == addr
    env = dict(SPANS, MASTER_ADDR=addr, NCCL_SOCKET_IFNAME="users")
    assert net.pick_interface(env=env) == name
    assert env["GLOO_SOCKET_IFNAME"] == name and env["NCCL_SOCKET_IFNAME"] == "users"
