"""Runs the real daemon (``daemon.server.run_daemon``) over the TEST DOUBLE store, as a process.

Used by the tests' ``daemon_process`` fixture: ``python tests/daemon/daemon_proc.py
--config node.toml --swap-dir DIR [--read-delay-seconds S]``. Everything but the
store is the shipped daemon; the store is ``fake_store.FakeBackend``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from daemon.config import load_config  # noqa: E402
from daemon.server import run_daemon  # noqa: E402
from fake_store import FakeBackend  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--swap-dir", required=True)
    parser.add_argument("--swap-capacity-bytes", type=int, default=256 << 20)
    parser.add_argument("--read-delay-seconds", type=float, default=0.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    backend = FakeBackend(args.swap_dir, args.swap_capacity_bytes, config.pool.segment_bytes, args.read_delay_seconds)
    return run_daemon(config, backend)


if __name__ == "__main__":
    sys.exit(main())
