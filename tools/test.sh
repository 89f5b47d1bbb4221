#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest -q --file-progress "$@"
