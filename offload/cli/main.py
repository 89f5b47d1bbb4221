"""The ``offload`` command: ``demo`` (the main job), ``info``, ``daemon`` (the node service), ``status``,
``consolidate`` and ``estimate``."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import unicodedata
from typing import Any

from csrc.errors import OffloadError
from offload.units import format_bytes

logger = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/offload/daemon.sock"


def _info(_: argparse.Namespace) -> int:
    from cpu_adam import available_isas, default_num_threads, resolve_isa, thread_source
    from cpu_adam.threads import team_found

    if thread_source() == "pool":
        source = "its own pool (OFFLOAD_CPU_ADAM_THREADS=pool)"
    elif team_found():
        source = "torch's OpenMP team from the main thread, its own pool from others"
    else:
        source = "its own pool (no single libgomp loaded)"
    print(f"cpu_adam isa      {resolve_isa(None).name.lower()}")
    print(f"cpu_adam isas     {', '.join(i.name.lower() for i in available_isas())}")
    print(f"cpu_adam threads  {default_num_threads()}, on {source}")
    return 0


def _daemon(args: argparse.Namespace) -> int:
    from daemon.config import load_config
    from daemon.server import run_daemon

    overrides = {
        "server.socket_path": args.socket,
        "pool.capacity_bytes": args.pool_bytes,
        "pool.segment_bytes": args.segment_bytes,
        "sessions.default_quota_bytes": args.quota_bytes,
        "sessions.reattach_grace_seconds": args.grace_seconds,
        "swap.paths": args.swap_path,
        "swap.capacity_bytes": args.swap_bytes,
        "metrics.address": args.metrics_address,
    }
    config = load_config(args.config, overrides)
    return run_daemon(config)


def escape(text: str) -> str:
    """``text`` with control and format characters escaped (a job id cannot move the cursor or hide text)."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() and unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp"):
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def format_status(status: dict[str, Any]) -> str:
    """The STATUS reply as the table ``offload status`` prints."""
    pool, swap = status["pool"], status.get("swap", {})
    held = f", {format_bytes(pool['held_bytes'])} held by regions" if "held_bytes" in pool else ""
    lines = [
        f"engine      {escape(str(status['engine']))}",
        f"uptime      {status['uptime_seconds']:.0f} s",
        f"pool        {format_bytes(pool['used_bytes'])} reserved by quotas of {format_bytes(pool['capacity_bytes'])}{held}",
    ]
    if "capacity_bytes" in swap:
        share = swap["used_bytes"] / swap["capacity_bytes"] if swap["capacity_bytes"] else 0.0
        lines.append(f"swap        {format_bytes(swap['used_bytes'])} used of {format_bytes(swap['capacity_bytes'])} ({share:.0%})")
    lines += [
        f"moved       read {format_bytes(status['bytes_moved']['read'])} "
        f"({format_bytes(status['bytes_per_second']['read'])}/s), "
        f"write {format_bytes(status['bytes_moved']['write'])} ({format_bytes(status['bytes_per_second']['write'])}/s)",
        f"queue       {status['queued']} queued, {status['inflight']} in flight",
        f"metrics     {escape(str(status.get('metrics_address') or 'off'))}",
        "",
    ]
    header = ("JOB", "RANK", "UID", "STATE", "QUOTA", "HELD", "REGIONS", "HOST", "NVME", "IN FLIGHT", "DIRTY",
              "REGIONS BY TIER")
    rows = [header]
    for s in status["sessions"]:
        stats = s.get("stats", {})

        def b(key: str) -> str:
            return format_bytes(stats[key]) if isinstance(stats.get(key), (int, float)) else "-"
        by_tier = " ".join(f"{escape(t.lower())}={n}" for t, n in sorted(s.get("regions_by_tier", {}).items())) or "-"
        state = escape(str(s["state"]))
        if s.get("daemon_restarts"):  # taken over from a previous daemon (daemon.restart)
            state += (", reattached" if s.get("reattached_after_restart") else "") + \
                f" after {s['daemon_restarts']} daemon restart{'s' if s['daemon_restarts'] > 1 else ''}"
        rows.append((escape(str(s["job_id"])), str(s["rank"]), str(s.get("uid", "-")), state,
                     format_bytes(s["quota_bytes"]), b("host_pool_used_bytes"), str(stats.get("regions", "-")),
                     b("host_bytes"), b("nvme_bytes"), b("in_flight_bytes"), b("dirty_bytes"), by_tier))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    if len(rows) == 1:
        lines.append("(no sessions)")
    lines += format_jobs(status["sessions"])
    return "\n".join(lines)


def format_jobs(sessions: list[dict[str, Any]]) -> list[str]:
    """Jobs and their ranks: memory, tier use and step rate (from the ranks' JOB_STEP reports)."""
    jobs: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for s in sessions:
        jobs.setdefault((s.get("uid", "-"), str(s["job_id"])), []).append(s)
    if not jobs:
        return []
    out = ["", "jobs"]
    for (uid, job_id), ranks in sorted(jobs.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        training = [r.get("training") or {} for r in ranks]
        held = sum(r.get("stats", {}).get("host_pool_used_bytes", 0) for r in ranks)
        nvme = sum(r.get("stats", {}).get("nvme_bytes", 0) for r in ranks)
        rate = sum(t.get("steps_per_second", 0.0) for t in training)
        out.append(f"  {escape(job_id)} (uid {uid}): {len(ranks)} rank{'s' if len(ranks) != 1 else ''}, host "
                   f"{format_bytes(held)} of {format_bytes(sum(r['quota_bytes'] for r in ranks))} quota, nvme "
                   f"{format_bytes(nvme)}, {rate:.2f} steps/s in all")
        for r, t in sorted(zip(ranks, training), key=lambda rt: rt[0]["rank"]):
            stats = r.get("stats", {})
            step = (f"step {t['step']}, {t['steps_per_second']:.2f} steps/s, {t['mean_step_seconds']:.3f} s/step, "
                    f"I/O wait {t['io_wait_seconds_total']:.1f} s, moved read {format_bytes(t['read_bytes_total'])} "
                    f"write {format_bytes(t['write_bytes_total'])}, loss scale {t['loss_scale']:g}") if t else "no steps reported"
            out.append(f"    rank {r['rank']} {escape(str(r['state']))}: host "
                       f"{format_bytes(stats.get('host_pool_used_bytes', 0))} of {format_bytes(r['quota_bytes'])}, "
                       f"nvme {format_bytes(stats.get('nvme_bytes', 0))}; {step}")
    return out


def _status(args: argparse.Namespace) -> int:
    from daemon.control import daemon_status

    socket_path = args.socket
    if socket_path is None:
        if args.config is not None:
            from daemon.config import load_config
            socket_path = load_config(args.config).server.socket_path
        else:
            socket_path = DEFAULT_SOCKET
    status = daemon_status(socket_path, timeout_seconds=args.timeout_seconds)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from offload.checkpoint.weights import consolidate, consolidate_safetensors

    if args.format == "safetensors":
        names = consolidate_safetensors(args.checkpoint, args.out, max_shard_size_bytes=args.max_shard_size_bytes)
        print(f"wrote {args.out}: {len(names)} safetensors file(s) (fp32 weights)")
        return 0
    state = consolidate(args.checkpoint, args.out)
    print(f"wrote {args.out}: {len(state)} entries, {sum(t.numel() for t in state.values())} elements (fp32 weights)")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from offload.cli.estimate import run_cli

    return run_cli(args)


def _demo(args: argparse.Namespace) -> int:
    from offload.cli.demo import DemoConfig, run_demo

    given = {"steps": args.steps, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
             "n_layer": args.n_layer, "n_embd": args.n_embd, "offload_device": args.device,
             "swap_dir": args.swap_dir, "daemon_socket": args.daemon_socket, "job_id": args.job_id,
             "seed": args.seed, "plot_path": args.plot,
             "delayed_update_warmup_steps": args.delayed_update}
    # A flag left out keeps DemoConfig's default, so the defaults live in one place.
    config = DemoConfig(show_progress=not args.no_progress, **{k: v for k, v in given.items() if v is not None})
    run_demo(config)
    return 0


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("tiered-offload")
    except Exception:  # a bare checkout on PYTHONPATH
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """--version, looked up only when asked: the package metadata scan costs `offload status` a tenth of a second."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"offload {_version()}")
        parser.exit()


def _log_level(text: str) -> int:
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise argparse.ArgumentTypeError(f"unknown log level {text!r} (debug, info, warning, error, critical)")
    return level


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload", description="Memory-tiered offload engine.")
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what this build runs: ISA paths, threads").set_defaults(fn=_info)

    m = sub.add_parser("demo", help="train a small GPT on the shipped corpus, optimizer offloaded to NVMe")
    m.add_argument("--steps", type=int, help="optimizer steps (300)")
    m.add_argument("--device", choices=("nvme", "cpu", "none"),
                   help="where the optimizer states go, offload_optimizer.device (nvme)")
    m.add_argument("--plot", metavar="PATH", help="also write the loss curve as a PNG (needs matplotlib)")
    m.add_argument("--micro-batch", type=int, help="windows of 64 characters per micro-batch (16)")
    m.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (1)")
    m.add_argument("--n-layer", type=int, help="decoder blocks (5)")
    m.add_argument("--n-embd", type=int, help="model width (128)")
    m.add_argument("--swap-dir", help="directory for the swap file (a temporary directory; none with a daemon)")
    m.add_argument("--daemon-socket", metavar="PATH",
                   help="train through the node daemon at this Unix socket, offload.daemon_socket "
                        "(default: $OFFLOAD_DAEMON_SOCKET if set, else the embedded store)")
    m.add_argument("--job-id", help="the job id the daemon keys the session by, offload.job_id "
                                    "(default: $TORCHELASTIC_RUN_ID, else 'default')")
    m.add_argument("--seed", type=int, help="model init and data seed (0)")
    m.add_argument("--delayed-update", type=int, metavar="WARMUP",
                   help="the one-step delayed parameter update after WARMUP ordinary steps (off)")
    m.add_argument("--no-progress", action="store_true", help="no progress (a bar on a terminal, else a line every 5 s), only the summary")
    m.add_argument("--log-level", type=_log_level, default=logging.WARNING)
    m.set_defaults(fn=_demo)

    d = sub.add_parser("daemon", help="run the node daemon in the foreground (SIGTERM drains and exits)")
    d.add_argument("--config", help="node.toml; flags below override it")
    d.add_argument("--socket", help="Unix socket path ([server] socket_path)")
    d.add_argument("--pool-bytes", type=int, help="node host pool ([pool] capacity_bytes)")
    d.add_argument("--segment-bytes", type=int, help="memfd segment size ([pool] segment_bytes)")
    d.add_argument("--quota-bytes", type=int, help="default session quota ([sessions] default_quota_bytes)")
    d.add_argument("--grace-seconds", type=float, help="reattach grace ([sessions] reattach_grace_seconds)")
    d.add_argument("--swap-path", action="append", help="swap directory, repeatable ([swap] paths)")
    d.add_argument("--swap-bytes", type=int, help="swap capacity ([swap] capacity_bytes)")
    d.add_argument("--metrics-address", help="host:port for /metrics, '' for none ([metrics] address)")
    d.add_argument("--log-level", type=_log_level, default=logging.INFO,
                   help="debug, info, warning, error or critical (any case)")
    d.set_defaults(fn=_daemon)

    s = sub.add_parser("status", help="what the daemon holds, as a table")
    s.add_argument("--socket", help=f"the daemon's socket (default: the --config file's, else {DEFAULT_SOCKET})")
    s.add_argument("--config", help="node.toml: read the socket path from its [server] table")
    s.add_argument("--json", action="store_true", help="the raw STATUS reply")
    s.add_argument("--timeout-seconds", type=float, default=10.0)
    s.set_defaults(fn=_status)

    c = sub.add_parser("consolidate", help="a checkpoint's fp32 weights as a state_dict file or safetensors")
    c.add_argument("checkpoint", help="the checkpoint directory (save_dir/tag), or save_dir (its 'latest' is read)")
    c.add_argument("out", help="the .pt file to write (torch.save of a state_dict); with --format safetensors, "
                               "the directory (sharded safetensors + index + config.json, as from_pretrained reads)")
    c.add_argument("--format", choices=("pt", "safetensors"), default="pt")
    c.add_argument("--max-shard-size-bytes", type=int, default=5 * 1024 ** 3,
                   help="--format safetensors: the most bytes per file (default 5 GiB)")
    c.set_defaults(fn=_consolidate)

    e = sub.add_parser("estimate", help="device, host and NVMe bytes per ZeRO stage and offload choice")
    if command == "estimate":  # its arguments come with torch; `offload status` must answer in well under 0.5 s
        from offload.cli.estimate import add_arguments

        add_arguments(e)
    e.set_defaults(fn=_estimate)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(_command(argv)).parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except OffloadError as exc:
        print(f"offload {args.command}: {exc}", file=sys.stderr)
        return 2

