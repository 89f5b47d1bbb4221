"""The ``offload`` command."""
from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger(__name__)


def _info(_: argparse.Namespace) -> int:
    from cpu_adam import available_isas, default_num_threads, resolve_isa

    print(f"cpu_adam isa      {resolve_isa(None).name.lower()}")
    print(f"cpu_adam isas     {', '.join(i.name.lower() for i in available_isas())}")
    print(f"cpu_adam threads  {default_num_threads()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload", description="Memory-tiered offload engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what this build runs: ISA paths, threads").set_defaults(fn=_info)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
