#!/usr/bin/env bash
# Runs mpi_fault_main under mpirun: `mpi_fault_test.sh MPIEXEC PROGRAM STRATEGY MODE [TIMEOUT_S]`. Checks a
# non-zero exit within 30 s (MODE exit) or within TIMEOUT_S + 30 s (MODE stop), and a message naming rank 1.
set -u
mpiexec="$1" program="$2" strategy="${3:-ulysses}" mode="${4:-exit}" timeout_s="${5:-600}"
limit=30
[ "$mode" = stop ] && limit=$(( ${timeout_s%.*} + 30 ))
start=$(date +%s)
out=$(timeout 180 "$mpiexec" --oversubscribe -np 4 "$program" "$strategy" "$mode" "$timeout_s" 2>&1)
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "$out" | tail -n 12
echo "exit code $rc after ${elapsed} s"
[ "$rc" -ne 0 ] || { echo "FAIL: the job exited 0"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout)"; exit 1; }
[ "$elapsed" -le "$limit" ] || { echo "FAIL: took ${elapsed} s (limit ${limit} s)"; exit 1; }
if [ "$mode" = stop ]; then
  echo "$out" | grep -q 'no progress from rank 1' || { echo "FAIL: no message names rank 1"; exit 1; }
else
  echo "$out" | grep -Eq '\[\[[0-9]+,1\],1\]|rank 1' || { echo "FAIL: no message names rank 1"; exit 1; }
fi
echo "PASS"
