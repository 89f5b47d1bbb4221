#!/usr/bin/env bash
# Wait until no other process holds apt's or dpkg's locks (an unattended upgrade, another
# install), saying who holds them, instead of failing. Used by tools/setup.sh before apt-get.
# OFL_APT_LOCKS (space-separated paths) and OFL_APT_LOCK_TIMEOUT (seconds, default 900) override.
set -euo pipefail
locks=${OFL_APT_LOCKS:-/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock}
timeout=${OFL_APT_LOCK_TIMEOUT:-900}
# The pid holding a POSIX (fcntl) lock on $1, as apt takes them, or nothing; asked with F_GETLK,
# which takes no lock itself.
holder() {
  python3 - "$1" <<'PY'
import fcntl, os, struct, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except OSError:
    sys.exit(0)
flock = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0)
l_type, _, _, _, pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, flock))
if l_type != fcntl.F_UNLCK:
    print(pid)
PY
}
start=$(date +%s)
said=0
while true; do
  busy=""
  for lock in $locks; do
    pid=$(holder "$lock")
    if [ -n "$pid" ]; then busy="$lock (pid $pid: $(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null || echo '?'))"; break; fi
  done
  [ -z "$busy" ] && exit 0
  waited=$(( $(date +%s) - start ))
  if [ "$waited" -ge "$timeout" ]; then
    echo "setup: the apt lock is still held after ${timeout} s: $busy" >&2
    exit 1
  fi
  if [ $(( waited / 15 )) -ge "$said" ]; then
    echo "setup: waiting for the apt lock, held by $busy (${waited} s so far, up to ${timeout} s)"
    said=$(( waited / 15 + 1 ))
  fi
  sleep 1
done
