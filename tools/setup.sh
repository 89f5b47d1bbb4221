#!/usr/bin/env bash
# Prepare this checkout on a fresh machine: the system packages the tests and benches
# use, a virtual environment at .venv with torch 2.13.0 (CPU build), and this project
# installed in place (its C compiled by cffi). Safe to run again: it only adds what is missing.
#   --if-changed   do nothing (in well under a second) when nothing it depends on changed since
#                  its last full run: the stamp in .venv/.setup-stamp covers pyproject.toml, this
#                  script, the C and its build scripts, the Python version and the apt packages.
#   --print-stamp  print that stamp and exit.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: fio (swap bench peer), prometheus (the daemon's scrape test), systemd (systemd-analyze
# verify of the daemon's unit).
APT_PACKAGES=(fio prometheus systemd)
STAMP_FILE=.venv/.setup-stamp
DS_VERSION=0.19.8
DS_SITE=.venv/ds-site

stamp() {
  {
    python3 --version 2>&1
    echo "${APT_PACKAGES[*]}"
    cat pyproject.toml tools/setup.sh csrc/*.c csrc/*.h csrc/build_*.py csrc/cffi_header.py 2>/dev/null
  } | sha256sum | cut -d' ' -f1
}

case "${1:-}" in
  --print-stamp) stamp; exit 0 ;;
  --if-changed)
    if [ -x .venv/bin/python ] && [ -f "$STAMP_FILE" ] && [ "$(cat "$STAMP_FILE")" = "$(stamp)" ]; then
      echo "setup: up to date (nothing changed since the last set-up)"
      exit 0
    fi ;;
  "") ;;
  *) echo "setup: unknown option $1 (--if-changed, --print-stamp)" >&2; exit 2 ;;
esac

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${missing[*]} with apt-get"
    bash tools/apt-wait.sh  # another apt (an unattended upgrade) may hold the lock: wait, saying so
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
    # Install without starting any service the packages ship (prometheus would take :9090).
    policy=/usr/sbin/policy-rc.d
    own_policy=0
    if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; own_policy=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
    [ "$own_policy" = 1 ] && rm -f "$policy"
  else
    echo "setup: not root or no apt-get; missing ${missing[*]} (their tests and benches will skip)"
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the virtual environment .venv"
  python3 -m venv .venv
fi
PY=.venv/bin/python
# pip, quiet unless it fails; the index's "Location ... ignored" notices are noise.
pip_install() {
  local out
  if ! out=$($PY -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    echo "$out" >&2
    return 1
  fi
  [ -z "$out" ] || grep -v '^WARNING: Location' <<<"$out" || true
}
# torch first and pinned: a looser requirement would pull the CUDA build's many GB.
if ! $PY -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU build): a large download the first time, a few minutes"
fi
pip_install torch==2.13.0
echo "setup: installing this project in place and compiling its C (cffi, gcc)"
# triton: the batched copy kernel's tests run under its interpreter; hf: the Hugging Face models' tests
pip_install -e '.[test,triton,hf,lightning]'
# The peer the step benches measure ours against: DeepSpeed in a directory of its own (.venv/ds-site), put on
# PYTHONPATH only by what runs it (tools/bench/step_deepspeed.py's callers, its test), never imported by this
# project: Accelerate and transformers change course when they find it importable. Its JIT CPU Adam builds
# on first use (ninja, from the same directory's bin/, and gcc).
echo "setup: installing DeepSpeed ${DS_VERSION} for the step benches' peer rows into $DS_SITE"
pip_install --target "$DS_SITE" --upgrade --no-deps --no-build-isolation "deepspeed==$DS_VERSION" hjson==3.1.0 \
  py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.2 ninja==1.13.2
stamp >"$STAMP_FILE"
echo "setup: done. \`source .venv/bin/activate\` puts the offload command on PATH (or run .venv/bin/offload)"
