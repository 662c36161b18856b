#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then builds and runs tests/consumer against it.
set -euo pipefail
build_dir="$1" source_dir="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/cpattn"
cmake -S "$source_dir" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/consumer"
