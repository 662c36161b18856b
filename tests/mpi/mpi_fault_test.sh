#!/usr/bin/env bash
# Runs mpi_fault_main under mpirun and checks: a non-zero exit, within 30 s, and a message naming rank 1.
set -u
mpiexec="$1" program="$2"
start=$(date +%s)
out=$(timeout 120 "$mpiexec" --oversubscribe -np 4 "$program" 2>&1)
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "$out" | tail -n 12
echo "exit code $rc after ${elapsed} s"
[ "$rc" -ne 0 ] || { echo "FAIL: the job exited 0"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout)"; exit 1; }
[ "$elapsed" -le 30 ] || { echo "FAIL: took ${elapsed} s"; exit 1; }
echo "$out" | grep -Eq '\[\[[0-9]+,1\],1\]|rank 1' || { echo "FAIL: no message names rank 1"; exit 1; }
echo "PASS"
