#!/usr/bin/env bash
# A strategy enumerator that the strategy table or the dispatch does not handle does not build: compiles the
# real header (include/cpattn/strategy.hpp, where -Wswitch is an error whatever the flags) and the real
# dispatch (src/cp/context_parallel.cpp, under the build's -Werror) with a fifth enumerator added through the
# header's test hook, and expects both to fail naming it; without it, both must compile (the control).
#   tests/strategy_check/check.sh CXX SOURCE_DIR [EXTRA_FLAGS...]
set -euo pipefail
cxx="$1" root="$2"
shift 2
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
compile() { "$cxx" -std=c++20 -fsyntax-only -I"$root/include" -I"$root/src" "$@" >"$out" 2>&1; }
header="$root/tests/strategy_check/traits_only.cpp"
dispatch="$root/src/cp/context_parallel.cpp"

compile "$header" || { cat "$out"; echo "FAIL: the header does not compile as it is"; exit 1; }
compile -Werror=switch "$@" "$dispatch" || { cat "$out"; echo "FAIL: the dispatch does not compile as it is"; exit 1; }
if compile -DCPATTN_TEST_EXTRA_STRATEGY=fifth "$header"; then
  echo "FAIL: strategy_traits built with an enumerator it does not handle"
  exit 1
fi
grep -q "fifth.*not handled in switch" "$out" || { cat "$out"; echo "FAIL: the header failed for another reason"; exit 1; }
if compile -DCPATTN_TEST_EXTRA_STRATEGY=fifth -Werror=switch "$@" "$dispatch"; then
  echo "FAIL: the dispatch built with an enumerator it does not handle"
  exit 1
fi
# The header's error comes first; the compiler goes on, and must name both dispatch switches by their lines (gcc and clang both print FILE:LINE:COL and "not handled in
# switch" with the enumerator's name).
mapfile -t lines < <(grep -n 'switch (parallel.strategy)' "$dispatch" | cut -d: -f1)
[ "${#lines[@]}" = 2 ] || { echo "FAIL: expected the two dispatch switches in $dispatch, found ${#lines[@]}"; exit 1; }
for line in "${lines[@]}"; do
  grep -Eq "context_parallel\.cpp:$line:[0-9]+:.*fifth.*not handled in switch" "$out" ||
    { cat "$out"; echo "FAIL: the dispatch switch at line $line was not reported"; exit 1; }
done
echo "strategy check: an unhandled enumerator fails strategy_traits, run_forward and run_backward"
