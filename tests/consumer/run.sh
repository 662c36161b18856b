#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then builds and runs tests/consumer against it (and imports the
# installed Python package, where the build has one).
set -euo pipefail
build_dir="$1" source_dir="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/cpattn"
cmake -S "$source_dir" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/consumer"
# The Python package, where the build has it: installed into the prefix's site directory and importable there.
if [ -f "$build_dir/python/cpattn/__init__.py" ] && ! /usr/bin/python3 -c "import numpy" 2>/dev/null; then
  echo "the installed Python package not imported: python3-numpy cannot be imported (scripts/setup installs it)"
elif [ -f "$build_dir/python/cpattn/__init__.py" ]; then
  site=$(find "$work/prefix" -path '*-packages/cpattn/__init__.py' -printf '%h\n' | head -n 1)
  test -n "$site" || { echo "cmake --install did not install the Python package" >&2; exit 1; }
  PYTHONPATH="$(dirname "$site")" /usr/bin/python3 -c "
import cpattn, numpy as np
assert cpattn.__file__.startswith('$work/prefix'), cpattn.__file__
q = np.ones((1, 8, 2, 4), np.float32)
o, lse = cpattn.attention(q, q, q)
assert np.allclose(o, 1.0), o
print('python package installed at', '$site')"
  # The same directory under /usr and /usr/local is one Debian's interpreter searches without PYTHONPATH.
  relative="$(dirname "${site#"$work/prefix/"}")"
  /usr/bin/python3 -c "
import sys
for prefix in ('/usr', '/usr/local'):
    assert prefix + '/$relative' in sys.path, (prefix + '/$relative', sys.path)"
fi
