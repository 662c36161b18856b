#!/usr/bin/env bash
# Runs one pytest file of tests/python with Debian's interpreter: run.sh PYTHON FILE [pytest args].
# Exits 77 (CTest: skipped), saying which package is missing, where python3-pytest, python3-numpy,
# python3-torch or python3-mpi4py cannot be imported (scripts/setup installs them).
set -euo pipefail
python="$1"
file="$2"
shift 2
cd "$(dirname "$0")"
for module in pytest:python3-pytest numpy:python3-numpy torch:python3-torch mpi4py:python3-mpi4py; do
  if ! "$python" -c "import ${module%%:*}" 2>/dev/null; then
    echo "SKIP: ${module##*:} cannot be imported by $python (scripts/setup installs it; apt-get failed?)"
    exit 77
  fi
done
export PYTHONDONTWRITEBYTECODE=1
exec "$python" -m pytest -q -rs -p no:cacheprovider "$file" "$@"
