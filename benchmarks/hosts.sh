#!/usr/bin/env bash
# Hosts on one machine for people (tests/hosts.py is the same for tests). Needs root
# (CAP_NET_ADMIN) and iproute2.
#
#   benchmarks/hosts.sh up N [RATE]   N namespaces rkvhsh-0..N-1 on a bridge, each link shaped to
#                                     RATE with tbf (tc's units: 100mbit, 1gbit, 10gbit; none:
#                                     unshaped; default 1gbit). Host I is 198.18.0.<I+1>/24 on
#                                     interface rkvhshh<I>; no default route, no link outside.
#   benchmarks/hosts.sh run I CMD...  run CMD on host I (a first word `python` is the repository's
#                                     .venv/bin/python; the repository is on PYTHONPATH)
#   benchmarks/hosts.sh addr I        host I's address
#   benchmarks/hosts.sh down          stop what runs on the hosts and remove them all
#
# Each host's /etc/hosts maps this machine's hostname to 127.0.1.1 (Ubuntu's default), as on the
# machines of docs/usage.md's recipe. Example (two hosts, 2 ranks each, the ring benchmark):
#   sudo benchmarks/hosts.sh up 2 1gbit
#   sudo benchmarks/hosts.sh run 0 python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 \
#       --node-rank 0 --master-addr 198.18.0.1 --master-port 29500 benchmarks/ring_profile.py &
#   sudo benchmarks/hosts.sh run 1 python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 \
#       --node-rank 1 --master-addr 198.18.0.1 --master-port 29500 benchmarks/ring_profile.py
#   sudo benchmarks/hosts.sh down
set -euo pipefail

TAG=rkvhsh
SW=$TAG-sw
BR=${TAG}b
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() { echo "hosts.sh: $*" >&2; exit 2; }

hosts() { ip netns list | awk '{print $1}' | grep -E "^$TAG-[0-9]+$" || true; }

down() {
    for ns in $(hosts) $(ip netns list | awk '{print $1}' | grep -x "$SW" || true); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true  # its veths (and their peers) and the bridge go too
        rm -rf "/etc/netns/$ns"
    done
}

up() {
    local n=${1:-} rate=${2:-1gbit}
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 250)) || die "up N [RATE]: N is 1 to 250 hosts"
    [[ $rate == none || $rate =~ ^[0-9.]+[kmgt]?(bit|bps)$ ]] ||
        die "RATE $rate: use tc's units (100mbit, 1gbit, 10gbit) or none"
    command -v tc >/dev/null || die "needs tc (iproute2)"
    down  # an earlier run's hosts
    trap 'echo "hosts.sh: up failed; removing what it made" >&2; down' ERR INT TERM
    ip netns add "$SW"
    ip -n "$SW" link add "$BR" type bridge
    ip -n "$SW" link set "$BR" up
    for ((i = 0; i < n; i++)); do
        local ns=$TAG-$i h=${TAG}h$i s=${TAG}s$i
        mkdir -p "/etc/netns/$ns"
        printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n127.0.1.1 %s\n' \
            "$(hostname)" >"/etc/netns/$ns/hosts"
        ip netns add "$ns"
        ip link add "$h" netns "$ns" type veth peer name "$s"
        ip link set "$s" netns "$SW"
        ip -n "$SW" link set "$s" master "$BR"
        ip -n "$ns" addr add "198.18.0.$((i + 1))/24" dev "$h"
        ip -n "$ns" link set lo up
        for end in "$ns $h" "$SW $s"; do
            set -- $end
            ip -n "$1" link set "$2" up
            if [[ $rate != none ]]; then
                # a 10 ms bucket, at least 64 KiB; 50 ms of queue
                local burst
                burst=$(python3 -c "import re,sys;m=re.fullmatch(r'([0-9.]+)([kmgt]?)(bit|bps)','$rate');b=float(m[1])*{'':1,'k':1e3,'m':1e6,'g':1e9,'t':1e12}[m[2]]*(8 if m[3]=='bps' else 1);print(max(65536,int(b/8/100)))")
                ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst "$burst" latency 50ms
            fi
        done
        echo "host $i: $ns, $h 198.18.0.$((i + 1))/24, link ${rate}"
    done
    trap - ERR INT TERM
}

run() {
    local i=${1:-}
    [[ $i =~ ^[0-9]+$ ]] || die "run I CMD...: I is a host number"
    shift
    (($# > 0)) || die "run I CMD...: no command"
    hosts | grep -qx "$TAG-$i" || die "no host $i (run: hosts.sh up N first)"
    if [[ $1 == python && -x $REPO/.venv/bin/python ]]; then
        shift
        set -- "$REPO/.venv/bin/python" "$@"
    fi
    cd "$REPO"
    exec ip netns exec "$TAG-$i" env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$@"
}

case ${1:-} in
up) shift; up "$@" ;;
run) shift; run "$@" ;;
addr) [[ ${2:-} =~ ^[0-9]+$ ]] || die "addr I"; echo "198.18.0.$((${2} + 1))" ;;
down) down ;;
*) die "usage: hosts.sh up N [RATE] | run I CMD... | addr I | down" ;;
esac
