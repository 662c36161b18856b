#!/usr/bin/env bash
# No function or lambda in src/ over 120 lines: clang-tidy's readability-function-size on every translation unit
# of the library (and the headers of src/ they include), with the build's compile commands.
#   tests/function_size.sh BUILD_DIR SOURCE_DIR      the library's sources
#   tests/function_size.sh --file FILE               one file, no compile database (the negative control)
set -euo pipefail
checks='-*,readability-function-size'
config='{CheckOptions: [{key: readability-function-size.LineThreshold, value: 120}]}'
if [ "$1" = --file ]; then
  exec clang-tidy --quiet --checks="$checks" --config="$config" --warnings-as-errors='*' "$2" -- -std=c++20
fi
build_dir="$1" source_dir="$2"
cd "$source_dir"
# -w: the compiler's own warnings (gcc flags clang does not know) are not this check's business.
find src -name '*.cpp' -print0 | sort -z | xargs -0 -n 1 -P "$(nproc)" \
  clang-tidy --quiet -p "$build_dir" --checks="$checks" --config="$config" --warnings-as-errors='*' \
  --header-filter="^$source_dir/src/" --extra-arg=-w
echo "function size: no function or lambda in src/ over 120 lines"
