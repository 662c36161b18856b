#!/usr/bin/env bash
# Hosts for real on one machine: two Linux network namespaces ("hosts", each with its own network stack and
# one address of 198.18.0.0/15, a range reserved for benchmarking network devices, RFC 2544) on a bridge in the
# machine's own namespace, which holds an address of the range too; mpirun runs here and starts its daemons in
# the namespaces through an rsh agent (netns_agent), and Open MPI's TCP transport is the only one it may use
# (btl tcp,self), on the test range only. Everything it made is removed on exit, also on failure; traffic
# stays on the bridge. Needs root (CAP_NET_ADMIN); elsewhere it exits 77, which CTest reports as skipped.
#
#   netns_hosts.sh CPATTN CASE
#     strategies   hybrid 2 hosts x 2 ranks (U = 2) and 2 x 4 (U = 4), ulysses and ring across the hosts, each
#                  checked against the single-device kernel; the bytes that crossed hosts as the report counts
#                  them (hosts told apart by MPI_Comm_split_type, as Open MPI does)
#     rank-killed  a rank on the second host killed (SIGKILL) mid-run: the job ends non-zero within 30 s and
#                  mpirun names the rank
#     link-cut     the second host's link taken down mid-run: the ranks that wait reach the MPI backend's
#                  deadline (--comm-timeout 10), the first host's print which rank made no progress, every rank
#                  process ends on its own within the deadline plus 20 s; the fixture then ends mpirun and the
#                  daemons, which TCP alone would leave retrying for many minutes
#     speed        each strategy across the hosts at a larger size (MULTIHOST_SEQ, default 16384): its time and
#                  its waiting on the link (docs/performance.md)
set -uo pipefail

cpattn=$(realpath "$1")
case_name=$2
# What is not the behaviour under test (mpirun's start, MPI_Init over TCP, a run's compute) is waited for until
# it is done, however busy the machine, up to this fixture's own limit, below CTest's (240 s): a bound there
# would fail the test for the machine's load, not for cpattn.
fixture_end=$((SECONDS + 220))
here=$(cd "$(dirname "$0")" && pwd)

skip() {
  echo "multihost: skipped: $*"
  exit 77
}
fail() {
  echo "multihost ($case_name): FAIL: $*" >&2
  exit 1
}

[ "$(id -u)" -eq 0 ] || skip "making network namespaces needs root (CAP_NET_ADMIN)"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
command -v mpirun >/dev/null || skip "no mpirun"
command -v python3 >/dev/null || skip "no python3 (reads the JSON reports)"

# What an earlier run killed before its EXIT trap could run left behind (its pid is in the names): removed.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^cpm[0-9]+h[0-9]+$'); do
  owner=${ns#cpm}
  owner=${owner%h*}
  if ! kill -0 "$owner" 2>/dev/null; then
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  fi
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^cpm[0-9]+(b|v[0-9]+)$'); do
  owner=${link#cpm}
  owner=${owner%%[bv]*}
  kill -0 "$owner" 2>/dev/null || ip link del "$link" 2>/dev/null
done

# Names unique to this run (interface names have at most 15 characters), and a /24 of the test range that no
# route uses yet.
tag="cpm$$"
net=""
for ((i = 0; i < 250; ++i)); do
  candidate="198.18.$((($$ + i) % 250 + 1))"
  if [ -z "$(ip route show "$candidate.0/24" 2>/dev/null)" ]; then
    net=$candidate
    break
  fi
done
[ -n "$net" ] || fail "every /24 of 198.18.1.0 - 198.18.250.0 is routed already"
work=$(mktemp -d)
bridge="${tag}b"
hosts=()
mpirun_pid=""
watchdog=""

cleanup() {
  if [ -n "$mpirun_pid" ]; then
    kill -9 "$mpirun_pid" 2>/dev/null
    wait "$mpirun_pid" 2>/dev/null
  fi
  local ns left t
  for ((t = 0; t < 50; ++t)); do  # until the namespaces' processes are gone (at most 5 s), killing new ones too
    left=0
    for ns in "${hosts[@]}"; do
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
      left=$((left + $(ip netns pids "$ns" 2>/dev/null | wc -l)))
    done
    ((left == 0)) && break
    sleep 0.1
  done
  if [ -n "$watchdog" ]; then
    pkill -P "$watchdog" 2>/dev/null
    kill "$watchdog" 2>/dev/null
  fi
  for ns in "${hosts[@]}"; do ip netns del "$ns" 2>/dev/null; done
  for i in "${!hosts[@]}"; do ip link del "${tag}v$i" 2>/dev/null; done
  ip link del "$bridge" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo "multihost ($case_name): FAIL: out of time (${MULTIHOST_LIMIT:-200} s)" >&2; exit 1' TERM
trap 'exit 1' INT
# The script's own limit, below CTest's TIMEOUT (whose SIGKILL would skip the EXIT trap): cleanup still runs.
# Its output away from CTest's pipe, which would wait for it; cleanup ends it and its sleep.
(sleep "${MULTIHOST_LIMIT:-200}" && kill -TERM $$) >/dev/null 2>&1 &
watchdog=$!

probe="${tag}probe"
ip netns add "$probe" 2>/dev/null || skip "cannot make a network namespace here (ip netns add failed)"
ip netns del "$probe"

# make_hosts N: the bridge and N hosts; host i has address $net.(11 + i).
make_hosts() {
  ip link add "$bridge" type bridge || fail "cannot make the bridge"
  ip addr add "$net.1/24" dev "$bridge"
  ip link set "$bridge" up
  : >"$work/map"
  for ((i = 0; i < $1; ++i)); do
    local ns="${tag}h$i"
    ip netns add "$ns" || fail "cannot make namespace $ns"
    hosts+=("$ns")
    ip link add "${tag}v$i" type veth peer name eth0 netns "$ns" || fail "cannot make the veth pair of $ns"
    ip link set "${tag}v$i" master "$bridge" up
    ip -n "$ns" addr add "$net.$((11 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    echo "$net.$((11 + i)) $ns" >>"$work/map"
  done
  # Bridged traffic between the namespaces must flow (on a host with br_netfilter and a FORWARD policy of
  # DROP, e.g. where Docker runs, it does not): a TCP connection from the first host to the second.
  ip netns exec "${hosts[1]}" python3 -c "
import socket; s = socket.socket(); s.bind(('$net.12', 7999)); s.listen(1); s.settimeout(10); s.accept()" &
  local listener=$!
  sleep 0.3
  if ! ip netns exec "${hosts[0]}" python3 -c "
import socket; socket.create_connection(('$net.12', 7999), timeout=5)"; then
    kill "$listener" 2>/dev/null
    fail "no TCP between the namespaces over the bridge (br_netfilter with a FORWARD policy of DROP?)"
  fi
  wait "$listener"
}

# across SLOTS_PER_HOST NP ARGS...: mpirun over the hosts (slots each), output in $work/out, in the background;
# its pid in $mpirun_pid.
across() {
  local slots=$1 np=$2
  shift 2
  local spec="" i
  for ((i = 0; i < ${#hosts[@]}; ++i)); do spec+="${spec:+,}$net.$((11 + i)):$slots"; done
  CPATTN_NETNS_MAP="$work/map" TMPDIR="$work" mpirun --allow-run-as-root --oversubscribe --host "$spec" \
    -np "$np" --mca plm_rsh_agent "$here/netns_agent" --mca pml ob1 --mca btl tcp,self \
    --mca oob_tcp_if_include "$net.0/24" --mca btl_tcp_if_include "$net.0/24" \
    "$cpattn" run --backend mpi --threads 1 "$@" >"$work/out" 2>&1 &
  mpirun_pid=$!
}

# wait_job [SECONDS]: waits for mpirun; its exit status in $rc ("timeout" when it outlived SECONDS, or without
# SECONDS the fixture's limit).
wait_job() {
  local limit=${1:-$((fixture_end - SECONDS))} t=0
  while kill -0 "$mpirun_pid" 2>/dev/null && ((t < limit * 10)); do
    sleep 0.1
    t=$((t + 1))
  done
  if kill -0 "$mpirun_pid" 2>/dev/null; then
    rc=timeout
  else
    wait "$mpirun_pid"
    rc=$?
  fi
}

# The rank processes (cpattn) in the hosts' namespaces.
rank_pids() {
  local ns pid
  for ns in "${hosts[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == "$cpattn run "* ]] && echo "$pid"
    done
  done
}

# wait_computing NP: until NP rank processes have been running (state R) in 10 samples in a row, 0.1 s apart:
# past MPI_Init (which waits in usleep) and into the run. Their pids in $ranks. Readiness, not a time: it waits
# while mpirun runs, up to the fixture's limit.
wait_computing() {
  local np=$1 streak=0
  while ((SECONDS < fixture_end)); do
    kill -0 "$mpirun_pid" 2>/dev/null || return 1
    ranks=$(rank_pids)
    local running=0 pid
    for pid in $ranks; do
      [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = R ] && running=$((running + 1))
    done
    if ((running >= np)); then
      streak=$((streak + 1))
      ((streak >= 10)) && return 0
    else
      streak=0
    fi
    sleep 0.1
  done
  fail "the $np ranks were not seen computing within the fixture's limit: $(tail -5 "$work/out")"
}

# start_computing SLOTS_PER_HOST NP ARGS...: across, then wait_computing NP. A job that ends before its ranks
# compute (Open MPI's TCP start between the namespaces fails now and then on a busy machine: "Open MPI failed
# to TCP connect ... Remote host") is started once more, saying so; a second such end fails the test.
start_computing() {
  local attempt
  for attempt in 1 2; do
    across "$@"
    wait_computing "$2" && return 0
    wait "$mpirun_pid" 2>/dev/null
    echo "multihost: attempt $attempt: the job ended before its ranks computed: $(tail -3 "$work/out" | tr '\n' ' ')"
  done
  fail "the job ended twice before its $2 ranks were seen computing: $(tail -25 "$work/out")"
}

# run_across SLOTS NP ARGS...: across, then wait_job. A job whose launch failed before any rank ran (Open
# MPI's TCP start between the namespaces fails now and then on a busy machine: "ORTE does not know how to route
# a message", "failed to TCP connect", mpirun ending on a signal of its own) is started once more, saying so.
run_across() {
  local attempt
  for attempt in 1 2; do
    across "$@"
    wait_job
    [ "$rc" != 0 ] || return 0
    grep -q '"ok"' "$work/out" && return 0  # the program ran: its answer is the test's to judge
    grep -Eq "ORTE does not know how to route|failed to TCP connect|ORTE was unable to reliably start|daemon did not report back" \
      "$work/out" || return 0
    echo "multihost: attempt $attempt: the job's launch failed before the program ran: $(grep -Em1 "ORTE|TCP connect|daemon" "$work/out")"
  done
}

# alive PIDS...: those still running.
alive() {
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done
}

# check_run NAME EXPECT_HOSTS: the JSON report of a finished run: the check passed, the hosts as expected,
# and a line of what crossed hosts.
check_run() {
  local name=$1
  [ "$rc" = 0 ] || fail "$name: mpirun exited $rc: $(tail -20 "$work/out")"
  python3 - "$work/out" "$name" "$2" <<'EOF' || fail "$name: $(tail -20 "$work/out")"
import json, sys
text = open(sys.argv[1]).read()
report = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]
name, hosts = sys.argv[2], json.loads(sys.argv[3])
assert report["check"]["pass"], "check did not pass: " + json.dumps(report["check"])
assert report["hosts"]["of_rank"] == hosts, "hosts %s, expected %s" % (report["hosts"]["of_rank"], hosts)
cross = {}
for c in report["collectives"]:
    key = c["kind"] + ("/" + c["group"] if "group" in c else "")
    cross[key] = cross.get(key, 0) + c["bytes_sent_across_hosts"]
strategy = report["problem"]["strategy"]
if strategy == "hybrid":
    # The ulysses groups sit inside a host: their all-to-alls never cross; the ring does.
    assert cross.get("all_to_all/ulysses", 0) == 0, cross
    assert cross.get("collective_permute/ring", 0) > 0, cross
elif strategy == "ulysses":
    assert cross.get("all_to_all", 0) > 0, cross
s = report["seconds"]
print("multihost %-22s PASS  forward %.3f s, backward %.3f s, waiting on shifts %.3f s; rank 0 sent across hosts: %s"
      % (name, s["forward"], s["backward"], s["comm_wait"],
         ", ".join("%s %d B" % (k, v) for k, v in cross.items())))
EOF
}

shape=(--q-heads 8 --kv-heads 2 --head-dim 32 --comm-timeout 20 --check --json)
case "$case_name" in
  strategies)
    make_hosts 2
    run_across 2 4 --strategy hybrid --ulysses-degree 2 --cp 4 --seq 1024 --load-balance --segments 600,424 "${shape[@]}"
    check_run "hybrid 2x2 (U=2)" "[0, 0, 1, 1]"
    run_across 4 8 --strategy hybrid --ulysses-degree 4 --cp 8 --seq 1024 --load-balance "${shape[@]}"
    check_run "hybrid 2x4 (U=4)" "[0, 0, 0, 0, 1, 1, 1, 1]"
    run_across 2 4 --strategy ulysses --cp 4 --seq 1024 --segments 600,424 "${shape[@]}"
    check_run "ulysses 2x2" "[0, 0, 1, 1]"
    run_across 2 4 --strategy ring --cp 4 --seq 1024 --load-balance "${shape[@]}"
    check_run "ring 2x2" "[0, 0, 1, 1]"
    ;;
  rank-killed)
    make_hosts 2
    start_computing 2 4 --strategy ring --cp 4 --q-heads 8 --kv-heads 2 --head-dim 64 --seq 32768
    victim=$(for pid in $ranks; do ip netns identify "$pid" 2>/dev/null | grep -qx "${hosts[1]}" && echo "$pid"; done | head -1)
    [ -n "$victim" ] || fail "no rank process on the second host"
    victim_rank=$(tr '\0' '\n' <"/proc/$victim/environ" | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
    killed=$(date +%s.%N)
    kill -9 "$victim"
    wait_job 30
    took=$(awk "BEGIN { print $(date +%s.%N) - $killed }")
    [ "$rc" != timeout ] || fail "the job outlived 30 s after rank $victim_rank was killed: $(tail -5 "$work/out")"
    [ "$rc" != 0 ] || fail "the job exited 0 after rank $victim_rank was killed"
    grep -Eq "process rank $victim_rank with PID [0-9]+ on node [0-9.]+ exited on signal 9" "$work/out" ||
      fail "mpirun did not name rank $victim_rank: $(tail -20 "$work/out")"
    printf 'multihost rank-killed           PASS  rank %s (host 2) killed; mpirun exited %s after %.1f s naming it\n' \
      "$victim_rank" "$rc" "$took"
    ;;
  link-cut)
    make_hosts 2
    start_computing 2 4 --strategy ring --cp 4 --q-heads 8 --kv-heads 2 --head-dim 64 --seq 32768 --comm-timeout 10
    cut=$(date +%s.%N)
    ip link set "${tag}v1" down
    # Every rank process ends on its own: the first host's by MPI_Abort through mpirun, the second's (cut off
    # from mpirun) by the backend's own exit after MPI_Abort's grace period.
    t=0
    # shellcheck disable=SC2086
    while [ -n "$(alive $ranks)" ] && ((t < 300)); do
      sleep 0.1
      t=$((t + 1))
    done
    took=$(awk "BEGIN { print $(date +%s.%N) - $cut }")
    # shellcheck disable=SC2086
    left=$(alive $ranks | wc -l)
    sleep 0.5  # mpirun's last output
    grep -Eq "rank [0-9]+: no progress from rank [0-9, ]+ in .* for [0-9]+ s; ending the job" "$work/out" ||
      grep -Eq "rank [0-9]+: no progress from rank [0-9]+ in [0-9]+ s \(a ring shift" "$work/out" ||
      fail "no rank said which rank made no progress: $(tail -20 "$work/out")"
    ((left == 0)) || fail "$left rank process(es) still running $took s after the link was cut"
    line=$(grep -Em1 "no progress from rank" "$work/out")
    printf 'multihost link-cut              PASS  every rank process ended %.1f s after the cut (deadline 10 s); "%s"\n' \
      "$took" "$line"
    # mpirun and the second host's daemon cannot reach each other: the fixture ends them (cleanup).
    ;;
  speed)
    make_hosts 2
    seq=${MULTIHOST_SEQ:-16384}
    big=(--q-heads 8 --kv-heads 2 --head-dim 128 --seq "$seq" --json)
    for s in "ulysses" "ring --load-balance" "hybrid --ulysses-degree 2 --load-balance" "all_gather --load-balance"; do
      # shellcheck disable=SC2086
      across 2 4 --strategy $s --cp 4 "${big[@]}"
      wait_job 600
      [ "$rc" = 0 ] || fail "$s: mpirun exited $rc: $(tail -20 "$work/out")"
      python3 - "$work/out" "$s" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
r = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]
s = r["seconds"]
cross = sum(c["bytes_sent_across_hosts"] for c in r["collectives"])
total = s["forward"] + s["backward"]
print("%-42s forward %.2f s, backward %.2f s, waiting on shifts %.2f s (%.0f%%); rank 0 sent %.1f MiB across hosts"
      % (sys.argv[2], s["forward"], s["backward"], s["comm_wait"], 100 * s["comm_wait"] / total, cross / 2**20))
EOF
    done
    ;;
  *)
    fail "unknown case '$case_name' (strategies, rank-killed, link-cut, speed)"
    ;;
esac
exit 0
