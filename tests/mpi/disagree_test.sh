#!/usr/bin/env bash
# Ranks that disagree on an option, under real mpirun: the program on two processes, rank 1 given one flag
# otherwise (a wrapper swaps its arguments). Each case must end within its bound with exit 2 on the job, the
# field named on stderr with each value and the rank holding it ("the ranks disagree on causal: true on rank
# 0; false on rank 1"), nothing computed (no "check:" line), nothing saved, and (the first field, also
# with --json) one document from rank 0. A last case runs the same flags on both ranks and passes its check.
# usage: disagree_test.sh MPIRUN CPATTN
set -uo pipefail
mpirun="$1"
cpattn="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Each refused case exits 2 on both ranks on its own; mpirun then ends the job through its kill sequence,
# which waits a second between its signals (twice) unless told not to: most of each case's time (Open MPI 4's
# ORTE parameter, as Debian 12 ships it).
export OMPI_MCA_odls_base_sigkill_timeout=0
base=(run --backend mpi --cp 2 --strategy ring --q-heads 4 --kv-heads 2 --head-dim 16 --seq 64 --threads 1
      --check --comm-timeout 30)
# Rank 1 runs the command line in $work/rank1.args (one argument a line); the others the base.
cat >"$work/wrap.sh" <<WRAP
#!/usr/bin/env bash
if [ "\$OMPI_COMM_WORLD_RANK" = 1 ]; then mapfile -t args <"$work/rank1.args"; exec "\${args[@]}"; fi
exec "\$@"
WRAP
chmod +x "$work/wrap.sh"

failures=0 cases=0
# case FIELD PHRASE BASE_EXTRA RANK1_EXTRA: the base with BASE_EXTRA on rank 0, with RANK1_EXTRA on rank 1
# (replacing the base's flag of the same name where it has one).
case_of() {
  local field="$1" phrase="$2" mine="$3" theirs="$4" json
  # --json (one document from rank 0) on the first field; the rest plain.
  local variants=("")
  ((cases < 2)) && variants+=(--json)
  for json in "${variants[@]}"; do
    cases=$((cases + 1))
    local args0=("${base[@]}") args1=("${base[@]}") extra
    read -r -a extra <<<"$mine"
    args0+=("${extra[@]}")
    read -r -a extra <<<"$theirs"
    # Replace a base flag that rank 1 gives otherwise (CLI11 refuses a flag given twice).
    local flag="${extra[0]:-}" i kept=()
    for ((i = 0; i < ${#args1[@]}; i++)); do
      if [ "${args1[$i]}" = "$flag" ] && [ "${#extra[@]}" -gt 1 ]; then
        i=$((i + 1))  # the flag and its value
        continue
      fi
      kept+=("${args1[$i]}")
    done
    args1=("${kept[@]}" "${extra[@]}")
    [ -n "$json" ] && args0+=(--json) && args1+=(--json)
    printf '%s\n' "$cpattn" "${args1[@]}" >"$work/rank1.args"
    local start=$SECONDS
    timeout 60 "$mpirun" --oversubscribe -np 2 "$work/wrap.sh" "$cpattn" "${args0[@]}" >"$work/out" 2>"$work/err"
    local rc=$? took=$((SECONDS - start)) bad=""
    [ "$rc" -eq 2 ] || bad="exit $rc (want 2)"
    grep -qF "the ranks disagree on $field" "$work/err" || bad="$bad; no 'the ranks disagree on $field'"
    grep -qF "$phrase" "$work/err" || bad="$bad; missing '$phrase'"
    grep -q "check:" "$work/out" && bad="$bad; it computed"
    [ -e "$work/saved" ] && bad="$bad; it saved"
    ((took <= 30)) || bad="$bad; took $took s"
    if [ -n "$json" ]; then
      local docs
      docs=$(grep -c '^{"ok": false' "$work/out")
      [ "$docs" = 1 ] || bad="$bad; $docs JSON documents"
    fi
    if [ -n "$bad" ]; then
      failures=$((failures + 1))
      echo "FAIL: $field ($mine | rank 1: $theirs) $json: $bad"
      tail -n 5 "$work/err"
    else
      echo "ok: $field ($mine | rank 1: $theirs) $json"
    fi
    rm -rf "$work/saved"
  done
}

case_of causal "true on rank 0; false on rank 1" "" "--no-causal"
case_of strategy "ring on rank 0; all_gather on rank 1" "" "--strategy all_gather"
case_of load_balance "false on rank 0; true on rank 1" "" "--load-balance"
case_of layout "contiguous on rank 0; per_document on rank 1" "" "--layout per_document"
case_of dtype "fp32 on rank 0; bf16 on rank 1" "" "--dtype bf16"
case_of seq_len "64 on rank 0; 128 on rank 1" "" "--seq 128"
case_of num_q_heads "4 on rank 0; 8 on rank 1" "" "--q-heads 8"
case_of num_kv_heads "2 on rank 0; 4 on rank 1" "" "--kv-heads 4"
case_of head_dim "16 on rank 0; 32 on rank 1" "" "--head-dim 32"
case_of batch "1 on rank 0; 2 on rank 1" "" "--batch 2"
case_of cp "2 on rank 0; 1 on rank 1" "" "--cp 1"
case_of --segments "(none) on rank 0; '40,24' on rank 1" "" "--segments 40,24"
case_of --seed "1 on rank 0; 7 on rank 1" "" "--seed 7"
case_of --save "(none) on rank 0; '$work/saved' on rank 1" "" "--save $work/saved"
case_of --threads "1 on rank 0; 2 on rank 1" "" "--threads 2"
case_of --comm-timeout "30 on rank 0; 20 on rank 1" "" "--comm-timeout 20"
case_of --remat "false on rank 0; true on rank 1" "" "--remat"
case_of --forward-only "false on rank 0; true on rank 1" "" "--forward-only"
case_of window_left "unset (unbounded) on rank 0; 8 on rank 1" "" "--window 8"
case_of softcap "unset (none) on rank 0; 30 on rank 1" "" "--softcap 30"
# Sinks ([Hq] fp32): given on rank 1 alone, and two files on the two ranks.
# npy_f32 FILE VALUE...: a float32 .npy of the values (version 1.0, the header padded to 64 bytes).
npy_f32() {
  local file="$1"
  shift
  perl -e 'my $d = "{\x27descr\x27: \x27<f4\x27, \x27fortran_order\x27: False, \x27shape\x27: (" .
    scalar(@ARGV) . ",), }"; $d .= " " x (64 - 10 - length($d) - 1) . "\n";
    print "\x93NUMPY\x01\x00", pack("v", length $d), $d, pack("f<*", @ARGV)' "$@" >"$file"
}
npy_f32 "$work/sinks.npy" 0.5 -1 2 0
npy_f32 "$work/other.npy" 0.5 -1 2 1
case_of sinks "false on rank 0; true on rank 1" "" "--sinks $work/sinks.npy"
case_of --sinks "'$work/sinks.npy' on rank 0; '$work/other.npy' on rank 1" "--sinks $work/sinks.npy" \
  "--sinks $work/other.npy"

# The same flags on both ranks: agreed, computed, checked.
printf '%s\n' "$cpattn" "${base[@]}" >"$work/rank1.args"
cases=$((cases + 1))
if timeout 120 "$mpirun" --oversubscribe -np 2 "$work/wrap.sh" "$cpattn" "${base[@]}" >"$work/out" 2>&1 &&
  grep -q "check: PASS" "$work/out"; then
  echo "ok: agreed flags run and pass their check"
else
  failures=$((failures + 1))
  echo "FAIL: agreed flags did not run"
  tail -n 10 "$work/out"
fi
echo "$cases cases, $failures failed"
[ "$failures" -eq 0 ]
