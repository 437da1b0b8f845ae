#!/usr/bin/env bash
# "Hosts" on one machine: N network namespaces, each joined to a bridge by a veth pair, with
# addresses in a private /24 that only these namespaces use; and Open MPI across them, one
# orted per namespace started through an rsh agent (docs/multihost.md).
#
#   hosts.sh [OPTIONS] up N               make N hosts (2..4) and leave them up
#   hosts.sh [OPTIONS] down               remove the hosts of --name
#   hosts.sh [OPTIONS] run N RANKS_PER_HOST [--] CMD [ARGS...]
#                                         make N hosts, run CMD under mpirun with RANKS_PER_HOST
#                                         ranks on each (ranks 0..R-1 on host 1, R..2R-1 on
#                                         host 2, ...), and remove the hosts afterwards, also
#                                         after a failure or Ctrl-C; exits with mpirun's code
# Options:
#   --name NAME    tag of the namespaces, bridge and veths (letters and digits, at most 6
#                  characters); default: the first free "fsN"
#   --subnet A.B.C the /24 to use (A.B.C.1 is the bridge, A.B.C.2.. the hosts); default:
#                  10.250.N, N as in the name, which must not overlap a route of this machine
#   --rate RATE    shape every host's link (both directions) to RATE with tbf, e.g. 1gbit
#   --delay DELAY  add DELAY to every host's link (both directions) with netem, e.g. 1ms
#   --verbose      print every ip/tc command and the mpirun command line
#   --mpirun-arg A one more argument for mpirun (repeat for more), e.g. --mpirun-arg=-x
#
# While `run` runs, FSDP_HOSTS_DIR names a folder that holds `hostfile`, `agent` and `name`,
# and FSDP_HOSTS_NAME the name, so that the command can reach the hosts: the namespace of
# host i is "${FSDP_HOSTS_NAME}h$i", its bridge-side veth "${FSDP_HOSTS_NAME}v$i".
#
# Exit codes: 77 when hosts cannot be made here (no `ip`, no CAP_NET_ADMIN: one line says
# why), 2 for bad usage, otherwise that of mpirun (run) or 0.
set -euo pipefail

readonly SKIP=77
prog=hosts.sh
die() { echo "$prog: $*" >&2; exit 2; }
skip() { echo "$prog: skipped: $*" >&2; exit $SKIP; }

name="" subnet="" rate="" delay="" verbose=0
mpirun_extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name=${2:?--name needs a value}; shift 2 ;;
    --name=*) name=${1#*=}; shift ;;
    --subnet) subnet=${2:?--subnet needs a value}; shift 2 ;;
    --subnet=*) subnet=${1#*=}; shift ;;
    --rate) rate=${2:?--rate needs a value}; shift 2 ;;
    --rate=*) rate=${1#*=}; shift ;;
    --delay) delay=${2:?--delay needs a value}; shift 2 ;;
    --delay=*) delay=${1#*=}; shift ;;
    --mpirun-arg) mpirun_extra+=("${2:?--mpirun-arg needs a value}"); shift 2 ;;
    --mpirun-arg=*) mpirun_extra+=("${1#*=}"); shift ;;
    --verbose) verbose=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || die "a subcommand is needed: up, down or run (see --help)"
cmd=$1; shift
[ -z "$name" ] || [[ "$name" =~ ^[a-z][a-z0-9]{0,5}$ ]] ||
  die "--name='$name': allowed: a lowercase letter, then up to 5 lowercase letters or digits"
[ -z "$subnet" ] || [[ "$subnet" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
  die "--subnet='$subnet': allowed: the first three numbers of a /24, e.g. 10.250.7"

run() {
  [ $verbose = 0 ] || echo "+ $*" >&2
  "$@"
}

state_root=/run/fsdp-hosts
lock=/run/lock/fsdp-hosts.lock

# The subnet of a name: the one it was made with, else --subnet, else 10.250.<digits of name>.
subnet_of() {
  if [ -f "$state_root/$1/subnet" ]; then cat "$state_root/$1/subnet"
  elif [ -n "$subnet" ]; then echo "$subnet"
  elif [[ "$1" =~ [0-9] ]]; then echo "10.250.$(( 10#${1//[!0-9]/} % 256 ))"
  else die "--name=$1 has no digits to choose a subnet 10.250.N from: give --subnet"; fi
}

# Does A.B.C.0/24 overlap an address or route of this machine (any namespace we can see)?
subnet_in_use() {
  local net=$1
  ip -4 route show table all 2>/dev/null | awk '{print $1}' | grep -q "^${net}\." && return 0
  ip -4 -o addr show 2>/dev/null | grep -q " ${net}\." && return 0
  return 1
}

# Removes every trace of hosts NAME: processes left in its namespaces (the ranks and orted
# that this script's mpirun started there), the namespaces (which deletes their veth ends),
# the bridge-side veths and the bridge, and Open MPI's shared-memory files of its hosts. Never
# fails.
down() {
  local n=$1 ns pid i
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${n}h[0-9]+$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -CONT "$pid" 2>/dev/null || true
                                                               kill -KILL "$pid" 2>/dev/null || true; done
    run ip netns del "$ns" 2>/dev/null || true
  done
  for i in 1 2 3 4; do
    ip link show "${n}v$i" >/dev/null 2>&1 && { run ip link del "${n}v$i" 2>/dev/null || true; }
  done
  ip link show "${n}br" >/dev/null 2>&1 && { run ip link del "${n}br" 2>/dev/null || true; }
  # Open MPI's shared-memory files of ranks that were killed (it names them after the host,
  # whose hostname is NAME's: nobody else's); the namespaces share this machine's /dev/shm.
  rm -f /dev/shm/vader_segment."${n}"h[0-9]*.* 2>/dev/null || true
  rm -rf "${state_root:?}/$n"
}

# Runs a tc command that adds netem; a kernel without sch_netem cannot delay (exit 77).
netem() {
  local err
  [ $verbose = 0 ] || echo "+ $*" >&2
  if ! err=$("$@" 2>&1); then
    if [[ "$err" == *"qdisc kind is unknown"* ]]; then
      skip "--delay needs the netem qdisc, which this kernel lacks (sch_netem); --rate works without it"
    fi
    echo "$err" >&2
    return 1
  fi
}

# Shapes one direction of a link: tbf for the rate, netem (under it) for the delay.
shape() {
  local dev=$1; shift
  local exec=("$@")
  if [ -n "$rate" ]; then
    run "${exec[@]}" tc qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst 256kb latency 100ms
    [ -z "$delay" ] || netem "${exec[@]}" tc qdisc add dev "$dev" parent 1:1 handle 10: netem delay "$delay" limit 100000
  elif [ -n "$delay" ]; then
    netem "${exec[@]}" tc qdisc add dev "$dev" root handle 10: netem delay "$delay" limit 100000
  fi
}

# Makes N hosts under a free name (or --name), and writes the hostfile and the agent into
# $state_root/<name>. Prints the name. RANKS_PER_HOST goes into the hostfile's slots.
up() {
  local hosts=$1 per=$2 i ns net
  [[ "$hosts" =~ ^[2-4]$ ]] || die "N='$hosts': allowed: 2 to 4 hosts"
  [[ "$per" =~ ^[1-9][0-9]*$ ]] || die "RANKS_PER_HOST='$per': allowed: 1 or more"
  command -v ip >/dev/null || skip "no 'ip' command (iproute2) to make network namespaces"
  [ -n "$rate$delay" ] && ! command -v tc >/dev/null && skip "no 'tc' command to shape the links"
  mkdir -p "$state_root" "$(dirname "$lock")" 2>/dev/null ||
    skip "cannot write $state_root (not root?): no CAP_NET_ADMIN for ip netns"
  { exec 9>>"$lock"; } 2>/dev/null || skip "cannot write $lock (not root?): no CAP_NET_ADMIN for ip netns"
  flock 9
  if [ -z "$name" ]; then
    for i in $(seq 1 250); do
      if ! ip link show "fs${i}br" >/dev/null 2>&1 && [ ! -e "$state_root/fs$i" ] &&
         { [ -n "$subnet" ] || ! subnet_in_use "10.250.$i"; }; then
        name=fs$i; break
      fi
    done
    [ -n "$name" ] || die "no free name fs1..fs250 (remove old hosts with '$prog --name fsN down')"
  elif ip link show "${name}br" >/dev/null 2>&1; then
    die "hosts '$name' exist already (remove them with '$prog --name $name down')"
  fi
  net=$(subnet_of "$name")
  if subnet_in_use "$net"; then
    die "the subnet $net.0/24 is in use on this machine: choose another with --subnet"
  fi
  # The namespace is the test of CAP_NET_ADMIN: nothing else is made without it.
  if ! err=$(ip netns add "${name}h1" 2>&1); then
    flock -u 9
    skip "no CAP_NET_ADMIN for ip netns (ip netns add: ${err//$'\n'/ })"
  fi
  mkdir -p "$state_root/$name"
  echo "$net" >"$state_root/$name/subnet"
  run ip link add "${name}br" type bridge
  flock -u 9
  run ip addr add "$net.1/24" dev "${name}br"
  run ip link set "${name}br" up
  : >"$state_root/$name/hostfile"
  for i in $(seq 1 "$hosts"); do
    ns=${name}h$i
    [ "$i" = 1 ] || run ip netns add "$ns"
    run ip link add "${name}v$i" type veth peer name eth0 netns "$ns"
    run ip link set "${name}v$i" master "${name}br" up
    run ip netns exec "$ns" ip addr add "$net.$((i + 1))/24" dev eth0
    run ip netns exec "$ns" ip link set eth0 up
    run ip netns exec "$ns" ip link set lo up
    shape "${name}v$i"
    shape eth0 ip netns exec "$ns"
    echo "$net.$((i + 1)) slots=$per" >>"$state_root/$name/hostfile"
  done
  # mpirun runs "agent HOST orted ARGS..." as it would run ssh: the agent starts the command
  # in the namespace of HOST's address (A.B.C.(i+1) -> <name>h<i>), with a hostname of its
  # own (a UTS namespace): Open MPI names its shared-memory files after the hostname and the
  # local rank, so hosts that share one hostname would map each other's files.
  cat >"$state_root/$name/agent" <<EOF
#!/bin/sh
h=\$1; shift
ns=${name}h\$(( \${h##*.} - 1 ))
exec ip netns exec "\$ns" unshare --uts sh -c 'hostname "\$1" && exec sh -c "\$2"' sh "\$ns" "\$*"
EOF
  chmod +x "$state_root/$name/agent"
  echo "$name" >"$state_root/$name/name"
}

case "$cmd" in
  up)
    [ $# -ge 1 ] || die "up needs N (2..4)"
    trap 'rc=$?; [ $rc = 0 ] || [ -z "$name" ] || down "$name"' EXIT
    up "$1" "${2:-1}"
    echo "$name: hosts ${name}h1..${name}h$1 on $(subnet_of "$name").0/24; hostfile and agent in $state_root/$name"
    ;;
  down)
    [ -n "$name" ] || die "down needs --name NAME"
    down "$name"
    ;;
  run)
    [ $# -ge 3 ] || die "run needs N RANKS_PER_HOST CMD..."
    hosts=$1 per=$2; shift 2
    [ "${1:-}" != -- ] || shift
    [ $# -ge 1 ] || die "run needs a command after N RANKS_PER_HOST"
    command -v mpirun >/dev/null || skip "no mpirun (Open MPI) to run across the hosts"
    # Removes the hosts however the script ends; Ctrl-C and TERM end mpirun first.
    mpirun_pid=""
    cleanup() {
      if [ -n "$mpirun_pid" ]; then kill -TERM "$mpirun_pid" 2>/dev/null || true; fi
      [ -z "$name" ] || down "$name"
    }
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    up "$hosts" "$per"
    net=$(subnet_of "$name")
    dir=$state_root/$name
    export FSDP_HOSTS_DIR=$dir FSDP_HOSTS_NAME=$name
    # PMIx's shared-memory store breaks across namespaces; the hash store works.
    export PMIX_MCA_gds=hash
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    args=(mpirun --hostfile "$dir/hostfile" -np $((hosts * per))
          --map-by slot --bind-to none --oversubscribe --allow-run-as-root
          --mca plm_rsh_agent "$dir/agent"
          --mca btl "tcp,self,vader"
          --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24"
          -x PMIX_MCA_gds)
    args+=("${mpirun_extra[@]}" "$@")
    [ $verbose = 0 ] || echo "+ ${args[*]}" >&2
    set +e
    "${args[@]}" &
    mpirun_pid=$!
    wait $mpirun_pid
    rc=$?
    set -e
    mpirun_pid=""
    exit $rc
    ;;
  *) die "unknown subcommand '$cmd': use up, down or run" ;;
esac
