#!/usr/bin/env bash
# Runs one pytest file of tests/python with Debian's interpreter: run.sh PYTHON FILE [pytest args].
# Exits 77 (CTest: skipped), saying which package is missing, where a package the file needs cannot be
# imported (scripts/setup installs them): python3-pytest, python3-numpy and python3-torch for every file,
# python3-mpi4py for the files that run under mpirun.
set -euo pipefail
python="$1"
file="$2"
shift 2
cd "$(dirname "$0")"
needs="pytest:python3-pytest numpy:python3-numpy torch:python3-torch"
case "$file" in
  test_mpi.py | test_training.py) needs="$needs mpi4py:python3-mpi4py" ;;
esac
for module in $needs; do
  if ! "$python" -c "import ${module%%:*}" 2>/dev/null; then
    echo "SKIP: ${module##*:} cannot be imported by $python (scripts/setup installs it; apt-get failed?)"
    exit 77
  fi
done
export PYTHONDONTWRITEBYTECODE=1
exec "$python" -m pytest -q -rs -p no:cacheprovider "$file" "$@"
