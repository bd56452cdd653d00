#!/usr/bin/env bash
# Run here (a machine that reaches PyPI), from anywhere in the checkout: downloads as CPython 3.12 x86-64 wheels what
# the project needs at run time beyond what the lent GPU machines hold, into two git-ignored folders of the checkout,
# each under the 64 MiB a device call may carry (the working tree travels too: keep both well under):
#   .gpu-a: duckdb and faiss-cpu (the two large ones)
#   .gpu-b: the rest (the service, its HTTP stack, embedded PostgreSQL, shapely, pycurl for switchyard_client, ...)
# The requirement list is read from pyproject.toml and client/pyproject.toml (pip resolves their dependencies), less
# what the GPU machines' image already holds (DEVICE_HAS). Then loadtests/device/on-device.sh installs them there:
# see docs/gpu.md (GPU checks on a machine without network access).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
PY=${PYTHON:-python3}
LIMIT_MB=${LIMIT_MB:-60}  # per folder; the call carries the working tree (~3 MB) as well, under 64 MiB in all
# In the GPU image (docs: the device tool's KINDS.md), at versions that work together there: never shipped.
DEVICE_HAS="numpy numba llvmlite numba-cuda pyarrow pandas psutil pytest pytest-timeout pluggy iniconfig pygments
uvloop python-dateutil six tzdata packaging cupy-cuda13x fastrlock"
A_PACKAGES="duckdb faiss-cpu"

for d in .gpu-a .gpu-b; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
rm -rf .gpu-a .gpu-b && mkdir -p .gpu-a .gpu-b
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The requirements: the service's and the client's runtime dependencies (the client itself comes from client/ on
# PYTHONPATH), and what the GPU test sets import beyond the image (httpx2: starlette's TestClient).
"$PY" - > "$tmp/requirements.txt" <<'PY'
import re, tomllib
def deps(path):
    with open(path, "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]
skip = {"switchyard-client"}
reqs = [d for d in deps("pyproject.toml") + deps("client/pyproject.toml")
        if re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() not in skip]
reqs += ["httpx2>=2.16"]
print("\n".join(dict.fromkeys(reqs)))
PY
echo "requirements: $(tr '\n' ' ' < "$tmp/requirements.txt")"
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$tmp/all" -r "$tmp/requirements.txt" 2>&1 | grep -v "is ignored: it is neither" || true

norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
for whl in "$tmp"/all/*.whl; do
  name=$(norm "$(basename "$whl" | cut -d- -f1)")
  case " $(echo $DEVICE_HAS) " in *" $name "*) continue ;; esac
  case "$name" in cuda-*|nvidia-*) continue ;; esac
  case " $A_PACKAGES " in *" $name "*) mv "$whl" .gpu-a/ ;; *) mv "$whl" .gpu-b/ ;; esac
done
status=0
for d in .gpu-a .gpu-b; do
  mb=$(du -sm "$d" | cut -f1)
  echo "$d: ${mb} MiB, $(ls "$d" | wc -l) wheels: $(ls "$d" | cut -d- -f1,2 | tr '\n' ' ')"
  if [ "$mb" -ge "$LIMIT_MB" ]; then echo "$d is over ${LIMIT_MB} MiB: move a wheel to the other folder"; status=1; fi
done
echo "then, on the GPU machine (two calls, back to back, so that the machine stays warm between them):"
echo "  1. carry .gpu-a:  bash loadtests/device/on-device.sh a"
echo "  2. carry .gpu-b:  bash loadtests/device/on-device.sh b python3 loadtests/gpu_check.py --out \$OUT"
exit $status
