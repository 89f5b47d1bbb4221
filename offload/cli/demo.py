"""``offload demo``: train a small GPT on the shipped corpus with the optimizer offloaded.

``run_demo(DemoConfig())`` builds a character-level GPT (``offload.models``), writes
a DeepSpeed-style config (ZeRO stage 2, ``offload_optimizer`` on NVMe in a temporary
directory, bf16 only where a GPU computes), hands both to ``offload.initialize`` and
runs the usual loop, ``loss = engine(x, y); engine.backward(loss); engine.step()``,
under a ``rich`` progress bar (loss, tokens/s, tier I/O in GB/s from the deltas of
``engine.offload_stats()``). It closes with a summary: where the optimizer states
lived, bytes moved, the time ``step()`` waited on I/O and its share of the step, the
first, last and validation loss, and the loss curve drawn in the terminal
(``offload.cli.termplot``), or also as a PNG where matplotlib is importable.

With ``daemon_socket`` (or ``$OFFLOAD_DAEMON_SOCKET``) it trains through that node
daemon instead of the embedded store: the states are a session of the daemon's, in
its pool and its swap, and no swap directory is made here.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from csrc.errors import ConfigError
from offload.config import OffloadSectionConfig, resolve_daemon_socket
from offload.units import format_bytes
from offload.models import GPT, CharTokenizer, GPTConfig, TextWindows, load_corpus, split_tokens
from offload.cli.termplot import describe_columns, plot_lines

logger = logging.getLogger(__name__)

__all__ = ["DemoConfig", "DemoResult", "run_demo", "ds_config", "format_summary"]

DEVICES = ("nvme", "cpu", "none")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What ``run_demo`` trains, and how it shows it."""

    steps: int = 300
    """Optimizer steps."""
    micro_batch: int = 16
    """Windows per forward/backward (train_micro_batch_size_per_gpu)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient_accumulation_steps)."""
    block_size: int = 64
    """Context length in characters."""
    n_layer: int = 5
    """Decoder blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Residual width."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 20
    """Optimizer steps of linear warm-up from lr/10 to lr."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    grad_clip_norm: float = 1.0
    """Global gradient norm clip (gradient_clipping); 0 for none."""
    offload_device: str = "nvme"
    """Where the optimizer states go: "nvme", "cpu" or "none" (offload_optimizer.device)."""
    swap_dir: str | None = None
    """Directory for the NVMe swap file; None: a TemporaryDirectory removed at the end (none through a
    daemon, which swaps to its own paths)."""
    daemon_socket: str | None = None
    """Unix socket of a node daemon to train through (offload.daemon_socket); None: $OFFLOAD_DAEMON_SOCKET
    where set, else the embedded store."""
    job_id: str | None = None
    """The job id the daemon keys the session by (offload.job_id); None: the engine's ($TORCHELASTIC_RUN_ID,
    else "default")."""
    seed: int = 0
    """Seed of the model's init and of the training windows' offsets."""
    state_dtype: str = "fp32"
    """How the Adam moments are stored: "fp32", "bf16" or "int8" (offload.state_dtype)."""
    grad_accum_dtype: str = "fp32"
    """The offloaded gradient accumulators: "fp32" or "bf16" (data_types.grad_accum_dtype)."""
    master_dtype: str = "fp32"
    """The offloaded master params: "fp32" or "bf16" (offload.master_dtype; bf16 needs a bf16 or int8 state_dtype)."""
    delayed_update_warmup_steps: int | None = None
    """None: ordinary steps; N: offload.delayed_update after N ordinary steps (offload.zero.delayed)."""
    val_windows: int = 64
    """Held-out windows the validation loss is the mean over."""
    plot_path: str | None = None
    """Also write the loss curve as a PNG here (needs matplotlib, not a dependency)."""
    plot_width_chars: int = 60
    """Width of the terminal loss plot in characters."""
    plot_height_rows: int = 5
    """Height of the terminal loss plot in text rows."""
    show_progress: bool = True
    """Show progress (the summary is printed either way): a bar on a terminal, else a plain line
    every ``progress_interval_seconds`` (a CI log, ``| tee``)."""
    progress_interval_seconds: float = 5.0
    """Seconds between the plain progress lines when the output is not a terminal (0: every step)."""
    compute_threads: int = 1
    """torch intra-op threads for forward/backward while the demo runs (0: torch's default).
    One, because on a small shared machine spinning OpenMP threads that lose their
    core cost far more than a second thread gains (10x slower steps measured here)."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch", "grad_accum", "block_size", "val_windows",
                     "plot_width_chars", "plot_height_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DemoConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.progress_interval_seconds >= 0:
            raise ConfigError(f"DemoConfig.progress_interval_seconds must be >= 0, got {self.progress_interval_seconds!r}")
        if self.compute_threads < 0:
            raise ConfigError(f"DemoConfig.compute_threads must be >= 0, got {self.compute_threads!r}")
        if self.offload_device not in DEVICES:
            raise ConfigError(f"DemoConfig.offload_device must be one of {DEVICES}, got {self.offload_device!r}")
        if self.delayed_update_warmup_steps is not None and self.delayed_update_warmup_steps < 0:
            raise ConfigError(f"DemoConfig.delayed_update_warmup_steps must be >= 0, "
                              f"got {self.delayed_update_warmup_steps!r}")
        if not self.lr > 0:
            raise ConfigError(f"DemoConfig.lr must be > 0, got {self.lr!r}")
        for name in ("daemon_socket", "job_id"):
            if getattr(self, name) == "":
                raise ConfigError(f"DemoConfig.{name} must be a non-empty string or None, got ''")


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """What a run measured; ``format_summary`` turns it into the closing text."""

    config: DemoConfig
    num_parameters: int
    vocab_size: int
    corpus_chars: int
    world_size: int
    losses: list[float]
    """Training loss per optimizer step (mean over its micro-batches)."""
    val_loss_before: float
    val_loss_after: float
    tokens_per_step: int
    train_seconds: float
    stats: Any
    """``engine.offload_stats()`` at the end (an ``EngineStats``)."""


def ds_config(config: DemoConfig, nvme_path: str | None) -> dict[str, Any]:
    """The DeepSpeed-style config dict that ``offload.initialize`` is given."""
    offload_optimizer: dict[str, Any] = {"device": config.offload_device}
    if config.offload_device == "nvme" and nvme_path is not None:  # none through a daemon: its own paths
        offload_optimizer["nvme_path"] = nvme_path
    extra: dict[str, Any] = {}
    if config.daemon_socket is not None:
        extra["offload"] = {"daemon_socket": config.daemon_socket}
    if config.job_id is not None:
        extra.setdefault("offload", {})["job_id"] = config.job_id
    if config.delayed_update_warmup_steps is not None:
        extra.setdefault("offload", {}).update(delayed_update=True,
                                               delayed_update_warmup_steps=config.delayed_update_warmup_steps)
    if config.state_dtype != "fp32":
        extra.setdefault("offload", {})["state_dtype"] = config.state_dtype
    if config.master_dtype != "fp32":
        extra.setdefault("offload", {})["master_dtype"] = config.master_dtype
    if config.grad_accum_dtype != "fp32":
        extra["data_types"] = {"grad_accum_dtype": config.grad_accum_dtype}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": config.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": config.lr, "betas": [0.9, 0.99], "eps": 1e-8,
                                                  "weight_decay": config.weight_decay}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": config.lr / 10, "warmup_max_lr": config.lr,
                                                     "warmup_num_steps": config.warmup_steps,
                                                     "warmup_type": "linear"}},
        "gradient_clipping": config.grad_clip_norm,
        "bf16": {"enabled": torch.cuda.is_available()},
        # sub-groups of 256 Ki elements: four here, so NVMe reads and writes overlap the Adam step
        "zero_optimization": {"stage": 2, "offload_optimizer": offload_optimizer, "sub_group_size": 1 << 18},
    }


def _batches(loader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, epoch after epoch (a sharded loader told the epoch)."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ConfigError("the training loader yields no batches: fewer windows than one micro-batch")
        epoch += 1


@torch.no_grad()
def _evaluate(engine, windows: TextWindows, micro_batch: int, device) -> float:
    """Mean loss of the engine's model over ``windows``, in eval mode."""
    engine.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), micro_batch):
        pairs = [windows[i] for i in range(start, min(start + micro_batch, len(windows)))]
        x = torch.stack([p[0] for p in pairs]).to(device)
        y = torch.stack([p[1] for p in pairs]).to(device)
        total += float(engine(x, y)) * len(pairs)
        count += len(pairs)
    engine.train()
    return total / count


def _io_bytes(stats) -> int:
    return stats.bytes_read_total + stats.bytes_written_total


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        BarColumn(bar_width=20), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tokens_per_s]:,.0f} tok/s"),
        TextColumn("I/O {task.fields[io_gb_per_s]:.2f} GB/s"),
        TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, disable=not enabled)


class _PlainProgress:
    """Progress as a line every few seconds, for output that is not a terminal (a bar there shows
    nothing until the end)."""

    def __init__(self, console: Console, total: int, interval_seconds: float) -> None:
        self.console, self.total, self.interval = console, total, interval_seconds
        self.start = self.last = time.perf_counter()

    def update(self, step: int, loss: str, tokens_per_s: float, io_gb_per_s: float) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval and step < self.total:
            return
        self.last = now
        self.console.print(f"step {step}/{self.total}  loss {loss}  {tokens_per_s:,.0f} tok/s  "
                           f"I/O {io_gb_per_s:.2f} GB/s  {now - self.start:.0f} s", highlight=False, markup=False)


def _train(engine, loader, config: DemoConfig, tokens_per_step: int, console: Console,
           show: bool) -> tuple[list[float], float]:
    """The loop; returns the per-step losses and the seconds it took."""
    device = getattr(engine, "device", torch.device("cpu"))
    batches = _batches(loader)
    losses: list[float] = []
    # (time, optimizer steps, tier bytes) of the last few steps: rates over a window.
    window: deque[tuple[float, int, int]] = deque(maxlen=11)
    start = time.perf_counter()
    window.append((start, 0, _io_bytes(engine.offload_stats())))
    plain = _PlainProgress(console, config.steps, config.progress_interval_seconds) \
        if show and not console.is_terminal else None
    with _progress(console, show and plain is None) as progress:
        task = progress.add_task("train", total=config.steps, loss="-", tokens_per_s=0.0, io_gb_per_s=0.0)
        for step in range(config.steps):
            step_loss = 0.0
            for _ in range(config.grad_accum):
                x, y = next(batches)
                loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                engine.step()
                step_loss += float(loss.detach()) / config.grad_accum
            losses.append(step_loss)
            now = time.perf_counter()
            window.append((now, step + 1, _io_bytes(engine.offload_stats())))
            (t0, s0, b0), (t1, s1, b1) = window[0], window[-1]
            dt = max(t1 - t0, 1e-9)
            rates = dict(loss=f"{step_loss:.3f}", tokens_per_s=(s1 - s0) * tokens_per_step / dt,
                         io_gb_per_s=(b1 - b0) / dt / 1e9)
            progress.update(task, advance=1, **rates)
            if plain is not None:
                plain.update(step + 1, **rates)
    return losses, time.perf_counter() - start


def _check_plot_path(path: str | None) -> None:
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"plot_path {path!r}: a PNG needs matplotlib, which is not installed "
                          "(the terminal plot is always shown)") from None


def save_png(losses: list[float], path: str) -> None:
    """The loss curve as a PNG at ``path`` (matplotlib must be importable)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title("offload demo: GPT on the shipped corpus")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _swap_dir(config: DemoConfig, socket: str | None, stack: contextlib.ExitStack) -> str | None:
    """The nvme_path to configure: the user's --swap-dir, else a temporary directory; none through a daemon,
    which swaps to its own paths."""
    if config.offload_device != "nvme" or config.swap_dir is not None or socket is not None:
        return config.swap_dir
    return stack.enter_context(tempfile.TemporaryDirectory(prefix="offload-demo-"))


def run_demo(config: DemoConfig, *, console: Console | None = None) -> DemoResult:
    """Train, show progress and the summary on ``console``, and return what was measured."""
    _check_plot_path(config.plot_path)
    socket = resolve_daemon_socket(OffloadSectionConfig(daemon_socket=config.daemon_socket))
    config = replace(config, daemon_socket=socket)  # the engine is given the socket the demo decided by
    console = console or Console()
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    train_tokens, val_tokens = split_tokens(tokenizer.encode(text))
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                          n_head=config.n_head, n_embd=config.n_embd), seed=config.seed)
    samples = config.steps * config.micro_batch * config.grad_accum
    train = TextWindows(train_tokens, block_size=config.block_size, num_windows=samples, seed=config.seed)
    val = TextWindows(val_tokens, block_size=config.block_size, num_windows=config.val_windows, seed=None)
    with contextlib.ExitStack() as stack:
        if config.compute_threads:
            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(config.compute_threads)
        swap_dir = _swap_dir(config, socket, stack)
        import offload

        engine, _, loader, _ = offload.initialize(model=model, config=ds_config(config, swap_dir),
                                                  training_data=train)
        stack.callback(engine.close)
        rank0 = engine.global_rank == 0
        device = getattr(engine, "device", torch.device("cpu"))
        tokens_per_step = config.micro_batch * config.grad_accum * config.block_size * engine.world_size
        val_before = _evaluate(engine, val, config.micro_batch, device)
        losses, seconds = _train(engine, loader, config, tokens_per_step, console, config.show_progress and rank0)
        val_after = _evaluate(engine, val, config.micro_batch, device)
        stats = engine.offload_stats()
    if config.offload_device == "nvme" and config.swap_dir is None and socket is None:  # no removed directory named
        stats = replace(stats, tier=stats.tier.replace(swap_dir, "a temporary directory, removed at the end"))
    result = DemoResult(config=config, num_parameters=model.num_parameters(),
                        vocab_size=tokenizer.vocab_size, corpus_chars=len(text), world_size=engine.world_size,
                        losses=losses, val_loss_before=val_before, val_loss_after=val_after,
                        tokens_per_step=tokens_per_step, train_seconds=seconds, stats=stats)
    if rank0:
        console.print(format_summary(result), highlight=False, markup=False, soft_wrap=True)
        if config.plot_path is not None:
            save_png(losses, config.plot_path)
            console.print(f"loss curve written to {config.plot_path}", highlight=False, markup=False, soft_wrap=True)
    return result


def format_summary(result: DemoResult) -> str:
    """The closing text: model, where the states lived, I/O, loss, and the loss curve."""
    c, s = result.config, result.stats
    losses = result.losses
    tail = losses[-min(10, len(losses)):]
    last = sum(tail) / len(tail)
    drop = (losses[0] - last) / losses[0] * 100 if losses[0] else 0.0
    optimizer = "AdamW through offload.initialize, ZeRO stage 2"
    tiers = ", ".join(f"{tier} {format_bytes(n)}" for tier, n in sorted(s.state_bytes_by_tier.items())) or "-"
    wait_share = s.io_wait_seconds_total / s.step_seconds_total * 100 if s.step_seconds_total else 0.0
    tokens = result.tokens_per_step * len(losses)
    lines = [
        "",
        f"model      GPT, {result.num_parameters / 1e6:.2f}M parameters ({c.n_layer} layers, {c.n_head} heads, "
        f"width {c.n_embd}, context {c.block_size}), {result.vocab_size} characters, "
        f"corpus {result.corpus_chars / 1000:.1f}k chars",
        f"optimizer  {optimizer}; device {s.optimizer_device}, tier {s.tier}, {result.world_size} rank(s)",
        f"states     {tiers} (fp32 master weights and Adam moments, at the end)",
        f"moved      read {format_bytes(s.bytes_read_total)}, written {format_bytes(s.bytes_written_total)} "
        "(NVMe <-> host)",
        f"I/O wait   {s.io_wait_seconds_total:.2f} s of {s.step_seconds_total:.2f} s in step() ({wait_share:.1f}%), "
        f"{s.optimizer_steps} optimizer steps",
        f"loss       {losses[0]:.3f} at step 1 -> {last:.3f} (mean of the last {len(tail)} steps): "
        f"down {drop:.0f}%",
        f"val loss   {result.val_loss_before:.3f} before -> {result.val_loss_after:.3f} after "
        f"({c.val_windows} held-out windows)",
        f"time       {result.train_seconds:.1f} s training, {tokens / result.train_seconds:,.0f} tokens/s",
        "",
        # The labels are column means, not the first loss printed above: the caption says so.
        f"training loss per optimizer step, {describe_columns(len(losses), c.plot_width_chars)} "
        "(y labels: the highest and lowest column)",
    ]
    plot = plot_lines(losses, width=c.plot_width_chars, height=c.plot_height_rows)
    axis = plot[0].index("┤")
    cells = len(plot[0]) - axis - 1
    lines += plot
    lines.append(" " * axis + "└" + "1".ljust(max(1, cells - len(str(len(losses))))) + str(len(losses)))
    return "\n".join(lines)
