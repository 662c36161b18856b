#!/usr/bin/env bash
# No function or lambda in src/ over 120 lines: clang-tidy's readability-function-size on every translation unit
# of the library (and the headers of src/ they include), with the build's compile commands.
#   tests/function_size.sh CLANG_TIDY BUILD_DIR SOURCE_DIR   the library's sources
#   tests/function_size.sh CLANG_TIDY --file FILE            one file, no compile database (the negative control)
set -euo pipefail
clang_tidy="$1"
shift
checks='-*,readability-function-size'
config='{CheckOptions: [{key: readability-function-size.LineThreshold, value: 120}]}'
if [ "$1" = --file ]; then
  exec "$clang_tidy" --quiet --checks="$checks" --config="$config" --warnings-as-errors='*' "$2" -- -std=c++20
fi
build_dir="$1" source_dir="$2"
cd "$source_dir"
# The headers of src/ too, as their path is a regular expression (the source path's own characters escaped).
header_filter="^$(printf '%s' "$PWD" | sed 's/[][\\.^$*+?(){}|]/\\&/g')/src/"
# -w: the compiler's own warnings (gcc flags clang does not know) are not this check's business.
find src -name '*.cpp' -print0 | sort -z | xargs -0 -n 1 -P "$(nproc)" \
  "$clang_tidy" --quiet -p "$build_dir" --checks="$checks" --config="$config" --warnings-as-errors='*' \
  --header-filter="$header_filter" --extra-arg=-w
echo "function size: no function or lambda in src/ over 120 lines"
