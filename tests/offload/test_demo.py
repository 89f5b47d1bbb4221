"""The demo end to end with a tiny model, its config dict, and the CLI."""
import io
import os
import tempfile
import importlib.util

import pytest
import torch
from rich.console import Console

from csrc.errors import ConfigError
from offload import cli
from offload.cli.demo import DemoConfig, DemoResult, ds_config, format_summary, run_demo
from offload.engine_stats import EngineStats
from tests.daemon.conftest import STORE
from tests.daemon.prom import scrape
from tests.daemon.test_refusals import errors

TINY = dict(steps=40, micro_batch=8, block_size=32, n_layer=1, n_head=2, n_embd=32, lr=1e-2, warmup_steps=5,
            val_windows=16, show_progress=False)
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _run(**kwargs):
    out = io.StringIO()
    result = run_demo(DemoConfig(**{**TINY, **kwargs}), console=Console(file=out, width=160))
    return result, out.getvalue()


def _assert_learns(result):
    losses = result.losses
    assert len(losses) == TINY["steps"]
    assert sum(losses[-5:]) / 5 < 0.85 * losses[0]
    assert result.val_loss_after < 0.9 * result.val_loss_before


@pytest.mark.parametrize("device", ["nvme", "cpu", "none"])
def test_offload_engine_loss_falls_and_states_live_where_asked(device, tmp_path):
    result, text = _run(offload_device=device, swap_dir=str(tmp_path) if device == "nvme" else None)
    _assert_learns(result)
    stats = result.stats
    assert stats.optimizer_device == device and stats.optimizer_steps == TINY["steps"]
    if device == "nvme":
        assert stats.bytes_written_total > 0 and stats.bytes_read_total > 0
        # on NVMe, or on its way there (on a loaded machine the last step's evicts can still be in flight)
        assert stats.state_bytes_by_tier.get("nvme", 0) + stats.state_bytes_by_tier.get("in_flight", 0) > 0
    if device == "cpu":
        assert stats.state_bytes_by_tier.get("host", 0) > 0
    assert "down" in text and "val loss" in text and "┤" in text
    assert f"{result.losses[0]:.3f} at step 1" in text


def test_ds_config_offloads_to_nvme_at_stage_2():
    config = DemoConfig(micro_batch=4, grad_accum=2)
    ds = ds_config(config, "/some/dir")
    assert ds["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/some/dir"},
                                       "sub_group_size": 1 << 18}
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["bf16"]["enabled"] == torch.cuda.is_available()
    assert ds_config(DemoConfig(offload_device="cpu"), None)["zero_optimization"]["offload_optimizer"] == {
        "device": "cpu"}


@pytest.mark.parametrize("kwargs, field", [({"steps": 0}, "steps"), ({"offload_device": "disk"}, "offload_device"),
                                           ({"compute_threads": -1}, "compute_threads")])
def test_bad_demo_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        DemoConfig(**kwargs)


def test_run_restores_torch_threads():
    threads = torch.get_num_threads()
    _run(steps=2, compute_threads=1, offload_device="cpu")
    assert torch.get_num_threads() == threads


def test_cli_demo_prints_the_summary(capsys):
    assert cli.main(["demo", "--steps", "3", "--n-layer", "1", "--n-embd", "32", "--device", "cpu",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "loss" in out and "└1" in out


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed")
def test_png_without_matplotlib_fails_before_training(capsys, tmp_path):
    assert cli.main(["demo", "--steps", "3", "--plot", str(tmp_path / "loss.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_png_is_written(tmp_path):
    path = tmp_path / "loss.png"
    _run(steps=3, plot_path=str(path), offload_device="cpu")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_lines_when_not_a_terminal_and_no_removed_swap_dir_in_the_summary(tmp_path, monkeypatch):
    """Output to a file (not a terminal): a plain progress line per interval (0 s here: every step,
    the last one included); the summary does not name the temporary swap directory removed at the end."""
    made = _recording_tempdirs(monkeypatch, tmp_path)
    result, text = _run(steps=4, offload_device="nvme", show_progress=True, progress_interval_seconds=0.0)
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], text
    assert f"loss {result.losses[-1]:.3f}" in lines[-1]
    assert len(made) == 1 and not os.path.exists(made[0].name)
    assert made[0].name not in text and "a temporary directory, removed at the end" in text, text


def test_progress_lines_wait_for_the_interval():
    _, text = _run(steps=3, offload_device="cpu", show_progress=True, progress_interval_seconds=3600.0)
    assert [line.split()[1] for line in text.splitlines() if line.startswith("step ")] == ["3/3"], text


def test_ds_config_names_the_daemon_and_the_job():
    """Issue 41: --daemon-socket and --job-id reach the engine as offload.daemon_socket and offload.job_id,
    beside the demo's other offload keys; without them the config names no daemon (the engine's own rule,
    $OFFLOAD_DAEMON_SOCKET else the embedded store, then applies)."""
    ds = ds_config(DemoConfig(daemon_socket="/run/offload/daemon.sock", job_id="demo-41",
                              delayed_update_warmup_steps=3), None)
    assert ds["offload"] == {"daemon_socket": "/run/offload/daemon.sock", "job_id": "demo-41",
                             "delayed_update": True, "delayed_update_warmup_steps": 3}
    assert "offload" not in ds_config(DemoConfig(), "/some/dir")
    with pytest.raises(ConfigError, match="daemon_socket"):
        DemoConfig(daemon_socket="")


def _recording_tempdirs(monkeypatch, tmp_path):
    made = []
    real = tempfile.TemporaryDirectory

    def recording(*args, **kwargs):
        made.append(real(*args, dir=str(tmp_path), **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "TemporaryDirectory", recording)
    return made


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
@pytest.mark.parametrize("named_by", ["flag", "env"])
def test_demo_trains_through_the_daemon_it_is_pointed_at(named_by, daemon, tmp_path, monkeypatch, capsys, caplog):
    """Issue 41: `offload demo --daemon-socket PATH` (or $OFFLOAD_DAEMON_SOCKET) trains through that daemon:
    its session comes (the job's steps in the daemon's metrics) and goes (no session at the end), no error
    is counted, and the demo neither makes a swap directory nor warns about an nvme_path it chose itself."""
    caplog.set_level("WARNING")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the session's reattach token, not in the real one
    made = _recording_tempdirs(monkeypatch, tmp_path)
    argv = ["demo", "--steps", "4", "--n-layer", "1", "--n-embd", "32", "--job-id", "demo-41", "--no-progress"]
    if named_by == "flag":
        argv += ["--daemon-socket", daemon.socket_path]
    else:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"device nvme, tier daemon {daemon.socket_path} (job 'demo-41', rank 0)" in out, out
    assert made == []
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "nvme_path" in m or "is not used" in m], said
    assert daemon.status()["sessions"] == []
    key = tuple(sorted({"uid": str(os.getuid()), "job": "demo-41", "rank": "0"}.items()))
    assert scrape(daemon.metrics_port)[("offload_job_steps_total", key)] == 4
    assert errors(daemon.metrics_port) == {}


def _summary(losses, width):
    stats = EngineStats(optimizer_device="cpu", tier="embedded TierStore (host memory)", state_bytes_by_tier={},
                        bytes_read_total=0, bytes_written_total=0, io_wait_seconds_total=0.0,
                        step_seconds_total=1.0, optimizer_steps=len(losses), skipped_steps=0)
    result = DemoResult(config=DemoConfig(plot_width_chars=width, plot_height_rows=3), num_parameters=1000,
                        vocab_size=60, corpus_chars=1000, world_size=1, losses=losses, val_loss_before=4.0,
                        val_loss_after=2.0, tokens_per_step=64, train_seconds=1.0, stats=stats)
    return format_summary(result).splitlines()


def test_the_loss_chart_says_it_plots_column_means_and_labels_their_range():
    """Issue 41: the chart's top label was a column mean, not the first loss printed above it, and nothing
    said so. Its caption names what a column is, and the labels are the highest and lowest column mean."""
    losses = [4.24, 3.9, 3.7, 3.6, 3.55, 3.2, 3.1, 3.0, 2.95, 2.9, 2.6, 2.55, 2.5, 2.45, 2.4,
              2.3, 2.3, 2.25, 2.2, 2.2]
    means = [sum(losses[i:i + 5]) / 5 for i in range(0, 20, 5)]  # 4 columns of 5 steps
    lines = _summary(losses, width=4)
    caption = next(i for i, line in enumerate(lines) if line.startswith("training loss"))
    assert "mean of 5 steps per column" in lines[caption], lines[caption]
    top, bottom = lines[caption + 1], lines[caption + 3]
    assert top.split("┤")[0].strip() == f"{max(means):.2f}" == "3.80"
    assert bottom.split("┤")[0].strip() == f"{min(means):.2f}"
    assert "4.240 at step 1" in "\n".join(lines)  # the first loss, which no column shows alone

    lines = _summary(losses[:3], width=4)  # fewer steps than columns: each column is one step
    caption = next(i for i, line in enumerate(lines) if line.startswith("training loss"))
    assert "one step per column" in lines[caption]
    assert lines[caption + 1].split("┤")[0].strip() == "4.24"
    assert lines[caption + 3].split("┤")[0].strip() == "3.70"
