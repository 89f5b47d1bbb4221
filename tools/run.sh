#!/usr/bin/env bash
# The README's main job: set up (skipped when nothing changed), then run it on the embedded default.
# Until the training engine lands, the main job is the CPU Adam benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh --if-changed
exec .venv/bin/python tools/bench/bench_adam.py "$@"
