#!/usr/bin/env bash
# Prepare this checkout on a fresh machine: the system packages the tests and benches
# use, a virtual environment at .venv with torch 2.13.0 (CPU build), and this project
# installed in place (its C compiled by cffi). Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: fio (swap bench peer), prometheus (the daemon's scrape test).
APT_PACKAGES=(fio prometheus)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${missing[*]}"
    apt-get update -qq >/dev/null
    # Install without starting any service the packages ship (prometheus would take :9090).
    policy=/usr/sbin/policy-rc.d
    own_policy=0
    if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; own_policy=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    [ "$own_policy" = 1 ] && rm -f "$policy"
  else
    echo "setup: not root or no apt-get; missing ${missing[*]} (their tests and benches will skip)"
  fi
fi

if [ ! -x .venv/bin/python ]; then
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
  grep -v '^WARNING: Location' <<<"$out" || true
}
# torch first and pinned: a looser requirement would pull the CUDA build's many GB.
pip_install torch==2.13.0
pip_install -e '.[test]'
