#!/usr/bin/env bash
# The README's main job: set up (skipped when nothing changed), then `offload demo` on the embedded default:
# a small GPT trained on the shipped corpus, optimizer states offloaded to NVMe in a
# temporary directory. Arguments pass through (`bash tools/run.sh --help`, `--steps 100`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh --if-changed
exec .venv/bin/offload demo "$@"
