#!/usr/bin/env bash
# No function or lambda over 120 lines in the library (src/), the program (tools/), the Python module (python/)
# or the benches (bench/): clang-tidy's readability-function-size on every translation unit there (and the
# headers of those folders they include), with the build's compile commands (the program's files are built in
# one unity file: clang-tidy takes their flags from the nearest entry).
#   tests/function_size.sh CLANG_TIDY BUILD_DIR SOURCE_DIR   the sources
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
# The headers of those folders too, as their path is a regular expression (the source path's own characters
# escaped).
header_filter="^$(printf '%s' "$PWD" | sed 's/[][\\.^$*+?(){}|]/\\&/g')/(src|tools|python|bench)/"
# -w: the compiler's own warnings (gcc flags clang does not know) are not this check's business.
find src tools python bench -name '*.cpp' -print0 | sort -z | xargs -0 -n 1 -P "$(nproc)" \
  "$clang_tidy" --quiet -p "$build_dir" --checks="$checks" --config="$config" --warnings-as-errors='*' \
  --header-filter="$header_filter" --extra-arg=-w
echo "function size: no function or lambda in src/, tools/, python/ or bench/ over 120 lines"
