#!/usr/bin/env bash
# Two "hosts" on this machine for multi-node tests: network namespaces dt_h0_TAG and dt_h1_TAG
# joined by a veth pair (dtv0_TAG in h0 = 10.231.7.1/24, dtv1_TAG in h1 = 10.231.7.2/24). The
# addresses exist only inside the two namespaces, so no traffic ever leaves them.
#
#   netns_two_hosts.sh up TAG              create both (idempotent: replaces leftovers of TAG)
#   netns_two_hosts.sh exec TAG I CMD...   run CMD in host I (0 or 1) with its own hostname
#                                          (dt-h<I>-TAG, in a private UTS namespace), so programs
#                                          that compare hostnames see two hosts
#   netns_two_hosts.sh txbytes TAG I       bytes host I has sent over its veth end so far
#   netns_two_hosts.sh down TAG            remove both (idempotent; ends what still runs in them)
#   netns_two_hosts.sh demo DTRUN CHILD    up, run `CHILD battery` on 2 nodes x 1 rank over UCX's
#                                          TCP transport, down (also on failure or Ctrl-C)
#
# Why the own hostname: the ucx backend takes equal hostnames for one host (and then lets UCX
# use shared memory, whose wake-up signals do not cross network namespaces: 50x slower).
#
# TAG: 1-8 characters [A-Za-z0-9] (interface names are limited to 15 bytes).
# Exit status of `up`: 0 done; 77 namespaces cannot be made here (not root, no `ip`, no
# CAP_SYS_ADMIN, no veth support; the reason is printed); 1 other errors. Whatever `up` made
# before failing is removed again, and so are namespaces of killed two_host_test runs (TAG =
# pid + letter, pid gone).
set -u

readonly SUBNET=10.231.7
readonly ADDR0=${SUBNET}.1 ADDR1=${SUBNET}.2

usage() {
  sed -n '2,22p' "$0" >&2
  exit 2
}

check_tag() {
  [[ "${1:-}" =~ ^[A-Za-z0-9]{1,8}$ ]] || { echo "netns_two_hosts: bad TAG '${1:-}'" >&2; exit 2; }
}

ns_name() { echo "dt_h$2_$1"; }
veth_name() { echo "dtv$2_$1"; }

down() {
  local tag=$1 i ns pids=()
  for i in 0 1; do
    ns=$(ns_name "$tag" "$i")
    if ip netns list 2>/dev/null | grep -qw "^$ns"; then
      # Whatever still runs in the namespace (only processes this script's `exec` started there).
      mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
      ((${#pids[@]} == 0)) || kill -9 "${pids[@]}" 2>/dev/null
      ip netns del "$ns" 2>/dev/null
    fi
  done
  # A veth end left in the root namespace by a failed `up`.
  for i in 0 1; do
    ip link show "$(veth_name "$tag" "$i")" >/dev/null 2>&1 && ip link del "$(veth_name "$tag" "$i")" 2>/dev/null
  done
  return 0
}

# Namespaces of two_host_test runs that were killed before they could clean up: their TAG is
# the test's pid and a letter, and that process no longer exists.
sweep() {
  local f name
  for f in /run/netns/dt_h[01]_*; do
    [[ -e "$f" ]] || continue
    name=${f##*/}
    [[ "$name" =~ ^dt_h[01]_([0-9]+)[a-z]$ ]] || continue
    kill -0 "${BASH_REMATCH[1]}" 2>/dev/null && continue
    down "${name#dt_h?_}"
  done
}

unavailable() {
  echo "netns_two_hosts: cannot make network namespaces here: $*" >&2
  exit 77
}

up() {
  local tag=$1 ns0 ns1 v0 v1 err
  ns0=$(ns_name "$tag" 0) ns1=$(ns_name "$tag" 1) v0=$(veth_name "$tag" 0) v1=$(veth_name "$tag" 1)
  [[ $(id -u) -eq 0 ]] || unavailable "not root (uid $(id -u))"
  command -v ip >/dev/null || unavailable "no 'ip' command (iproute2)"
  command -v unshare >/dev/null || unavailable "no 'unshare' command (util-linux)"
  down "$tag"
  sweep
  # From here on, a failure removes what was made.
  trap 'down "$tag"' EXIT
  err=$(ip netns add "$ns0" 2>&1) || unavailable "'ip netns add $ns0' failed: $err"
  err=$(ip netns add "$ns1" 2>&1) || unavailable "'ip netns add $ns1' failed: $err"
  err=$(ip netns exec "$ns0" true 2>&1) || unavailable "'ip netns exec $ns0' failed: $err"
  err=$(unshare --uts true 2>&1) || unavailable "'unshare --uts' failed: $err"
  err=$(ip link add "$v0" type veth peer name "$v1" 2>&1) || unavailable "cannot create a veth pair: $err"
  set -e
  ip link set "$v0" netns "$ns0"
  ip link set "$v1" netns "$ns1"
  ip -n "$ns0" addr add "$ADDR0/24" dev "$v0"
  ip -n "$ns1" addr add "$ADDR1/24" dev "$v1"
  for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
  ip -n "$ns0" link set "$v0" up
  ip -n "$ns1" link set "$v1" up
  # Wait (bounded) until both ends of the link are up.
  local k
  for k in $(seq 50); do
    ip -n "$ns0" link show "$v0" | grep -q 'state UP' && ip -n "$ns1" link show "$v1" | grep -q 'state UP' && break
    [[ $k -eq 50 ]] && { echo "netns_two_hosts: the veth link $v0 - $v1 did not come up" >&2; exit 1; }
    sleep 0.1
  done
  set +e
  trap - EXIT
  echo "$ns0 $v0 $ADDR0"
  echo "$ns1 $v1 $ADDR1"
}

cmd=${1:-}
case "$cmd" in
  up)
    check_tag "${2:-}"
    up "$2"
    ;;
  txbytes)
    check_tag "${2:-}"
    [[ "${3:-}" == 0 || "${3:-}" == 1 ]] || usage
    exec ip netns exec "$(ns_name "$2" "$3")" cat "/sys/class/net/$(veth_name "$2" "$3")/statistics/tx_bytes"
    ;;
  down)
    check_tag "${2:-}"
    down "$2"
    ;;
  exec)
    check_tag "${2:-}"
    if [[ $# -lt 4 || ("$3" != 0 && "$3" != 1) ]]; then usage; fi
    tag=$2 host=$3
    shift 3
    # shellcheck disable=SC2016  # $0 and $@ are the inner shell's
    exec ip netns exec "$(ns_name "$tag" "$host")" unshare --uts -- \
      sh -c 'hostname "$0" && exec "$@"' "dt-h$host-$tag" "$@"
    ;;
  demo)
    [[ $# -eq 3 ]] || usage
    dtrun=$2 child=$3 tag=demo$$
    tag=${tag:0:8}
    up "$tag" >/dev/null || exit $?
    trap 'down "$tag"' EXIT
    trap 'exit 130' INT TERM
    export UCX_TLS=tcp,self UCX_WARN_UNUSED_ENV_VARS=n DTENSOR_TIMEOUT_S=20
    # The same store secret on both hosts (dtrun makes one only for single-node jobs).
    DTENSOR_STORE_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export DTENSOR_STORE_SECRET
    rc=0
    for i in 0 1; do
      UCX_NET_DEVICES=$(veth_name "$tag" "$i") timeout -s KILL 120 "$0" exec "$tag" "$i" \
        "$dtrun" --nnodes 2 --node-rank "$i" --nproc-per-node 1 --master-addr "$ADDR0" --master-port 29517 \
        "$child" battery &
    done
    for i in 0 1; do wait -n || rc=$?; done
    exit "$rc"
    ;;
  *)
    usage
    ;;
esac
