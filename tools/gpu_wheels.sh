#!/usr/bin/env bash
# Download the wheels a lent GPU machine lacks into .whl/ (carried there by the device tool:
# carry [".whl"]), for tools/gpu_check.sh to install. Run it once in the checkout the device
# tool sends (the lead's), where pip reaches its index; the wheels are never committed: this
# script adds /.whl/ to that checkout's .git/info/exclude when the folder is not ignored yet.
#
# What the machine lacks: our package needs torch, numpy, cffi, aiofiles, prometheus-client
# and rich (pyproject.toml), plus pytest; the machine's image ('cuda', Python 3.12) has all of
# them but cffi and its dependency pycparser (the device docs' KINDS.md package list). cffi
# compiles our C there (setup.py's cffi_modules) and is its runtime (_cffi_backend). The DeepSpeed
# peer's wheels go to .whl/deepspeed/ (below).
#
#   bash tools/gpu_wheels.sh                 # into .whl/ of this checkout
#   bash tools/gpu_wheels.sh --dest DIR      # elsewhere (nothing is added to any exclude file)
#   PYVER=3.11 bash tools/gpu_wheels.sh ...  # for another Python (the machine's is 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."

CFFI_VERSION=${CFFI_VERSION:-2.1.1}
PYCPARSER_VERSION=${PYCPARSER_VERSION:-3.12}
PYVER=${PYVER:-3.12}
DEST=.whl
if [ "${1:-}" = "--dest" ]; then
  DEST=${2:?--dest needs a directory}
elif [ -n "${1:-}" ]; then
  echo "gpu_wheels: unknown option $1 (--dest DIR)" >&2
  exit 2
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

if [ "$DEST" = .whl ]; then
  mkdir -p .whl
  if ! git check-ignore -q .whl/probe.whl 2>/dev/null; then
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    echo "/.whl/" >>"$exclude"
    echo "gpu_wheels: added /.whl/ to $exclude"
  fi
fi

# manylinux tags: pip matches each exactly, so name the usual ones (the device README's list).
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# One version of each: an older download of the same package would stop the install there.
rm -f "$DEST"/cffi-*.whl "$DEST"/pycparser-*.whl
if ! out=$($PY -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$DEST" \
    "cffi==$CFFI_VERSION" "pycparser==$PYCPARSER_VERSION" 2>&1); then
  echo "$out" >&2
  exit 1
fi
grep -v '^WARNING: Location' <<<"$out" || true  # the index's notices are noise

# The peer's rows (tools/bench/step_deepspeed.py, step_hf.py): DeepSpeed and what it imports that the image
# lacks (hjson, pydantic with its compiled core and two small helpers; ninja, py-cpuinfo, msgpack, einops and
# psutil are there), in a folder of their own that gpu_check.sh puts on the path of the DeepSpeed stages only
# (Accelerate and transformers change course when they find DeepSpeed importable). DeepSpeed's wheel is
# built here from its source (pure Python: its ops are built by its JIT there, on first use).
DS_VERSION=${DS_VERSION:-0.19.8}
mkdir -p "$DEST/deepspeed"
rm -f "$DEST"/deepspeed/*.whl
if ! out=$($PY -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$DEST/deepspeed" \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 2>&1) ||
   ! out2=$($PY -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$DEST/deepspeed" \
    "deepspeed==$DS_VERSION" 2>&1); then
  echo "$out" "${out2:-}" >&2
  exit 1
fi
ls -l "$DEST"/*.whl "$DEST"/deepspeed/*.whl
echo "gpu_wheels: done; carry \"$DEST\" with the device call and run: bash tools/gpu_check.sh"
