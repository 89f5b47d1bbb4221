"""offload.config: DeepSpeed-style JSON/dict -> frozen dataclasses, every bad key and value named.

The oracle for defaults and key names is DeepSpeed's own config code (constants.py,
zero/config.py, zero/offload_config.py, precision_config.py, swap_tensor/constants.py,
lr_schedules.py), written out by hand below; for batch sizes it is the identity
train = micro * gas * world; for JSON positions it is the line and column of the
character we broke; for purity it is the file system and sys.modules themselves.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import sys

import pytest

import offload.config.read as config_module
from csrc.errors import ConfigError
from offload.config import (
    AioConfig, BatchConfig, EngineConfig, Fp16Config, OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig,
    OffloadSectionConfig, OptimizerConfig, SchedulerConfig, ZeroConfig, read_config, resolve_daemon_socket,
    resolve_job_id,
)

LOGGER = "offload.config"


@pytest.fixture(autouse=True)
def fresh_log_memory(monkeypatch):
    """Ignored/deprecated keys are logged once per process: give each test a fresh process's memory."""
    monkeypatch.setattr(config_module, "_logged", set())


def read(cfg, world_size=1):
    return read_config(cfg, world_size=world_size)


def with_batch(**sections):
    return {"train_batch_size": 8, **sections}


def full_config(nvme_path):
    return {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "steps_per_print": 50,
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                  "weight_decay": 0.1, "bias_correction": False}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4,
                                                          "warmup_num_steps": 100, "warmup_type": "linear",
                                                          "total_num_steps": 1000}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 0.5},
        "zero_optimization": {
            "stage": 2, "sub_group_size": 1e8, "overlap_comm": True, "contiguous_gradients": False,
            "reduce_scatter": False, "reduce_bucket_size": 2e8, "allgather_partitions": False,
            "allgather_bucket_size": 3e8, "round_robin_gradients": True,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False,
                                  "buffer_count": 6, "pipeline_read": True, "pipeline_write": True,
                                  "fast_init": True},
        },
        "aio": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": True,
                "overlap_events": False},
        "offload": {"daemon_socket": "/run/x.sock", "job_id": "j1", "host_memory_bytes": 1 << 30,
                    "swap_capacity_bytes": 1 << 34, "checksum": False},
    }


# ---- what a good config reads to -----------------------------------------------------------

def test_defaults_are_deepspeeds():
    c = read({"train_batch_size": 8})
    assert c.optimizer is None and c.scheduler is None
    assert (c.gradient_clipping, c.steps_per_print, c.wall_clock_breakdown) == (0.0, 10, False)
    assert dataclasses.asdict(c.fp16) == {"enabled": False, "loss_scale": 0.0, "initial_scale_power": 16,
                                          "loss_scale_window": 1000, "hysteresis": 2,
                                          "consecutive_hysteresis": False, "min_loss_scale": 1.0}
    assert c.bf16.enabled is False
    z = c.zero
    assert (z.stage, z.sub_group_size, z.reduce_bucket_size, z.allgather_bucket_size) == (0, 10**9, 5 * 10**8,
                                                                                          5 * 10**8)
    assert (z.contiguous_gradients, z.reduce_scatter, z.allgather_partitions, z.round_robin_gradients) == (
        True, True, True, False)
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold, z.stage3_max_live_parameters,
            z.stage3_max_reuse_distance) == (5 * 10**7, 10**5, 10**9, 10**9)
    oo = z.offload_optimizer
    assert (oo.device, oo.nvme_path, oo.buffer_count, oo.pipeline_read, oo.pipeline_write, oo.fast_init) == (
        OffloadDevice.NONE, None, 4, False, False, False)
    op = z.offload_param
    assert (op.device, op.buffer_count, op.buffer_size, op.max_in_cpu) == (OffloadDevice.NONE, 5, 10**8, 10**9)
    assert dataclasses.asdict(c.aio) == {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                                         "single_submit": False, "overlap_events": True, "use_gds": False}
    assert c.offload == OffloadSectionConfig()


def test_every_given_value_lands_in_its_field(tmp_path):
    c = read(full_config(str(tmp_path)), world_size=2)
    assert c.batch == BatchConfig(train_batch_size=64, micro_batch_size_per_gpu=4, gradient_accumulation_steps=8)
    assert (c.steps_per_print, c.gradient_clipping, c.wall_clock_breakdown) == (50, 1.0, True)
    assert c.optimizer == OptimizerConfig(type="adamw", lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                                          adamw_mode=True, bias_correction=False)
    assert c.scheduler == SchedulerConfig(type="WarmupDecayLR", warmup_min_lr=1e-5, warmup_max_lr=3e-4,
                                          warmup_num_steps=100, warmup_type="linear", total_num_steps=1000)
    assert c.fp16 == Fp16Config(enabled=True, loss_scale=0.0, initial_scale_power=12, loss_scale_window=500,
                                hysteresis=3, consecutive_hysteresis=True, min_loss_scale=0.5)
    assert c.zero.offload_optimizer == OffloadOptimizerConfig(
        device=OffloadDevice.NVME, nvme_path=str(tmp_path), pin_memory=False, buffer_count=6,
        pipeline_read=True, pipeline_write=True, fast_init=True)
    z = c.zero
    assert (z.stage, z.sub_group_size, z.overlap_comm, z.contiguous_gradients, z.reduce_scatter,
            z.reduce_bucket_size, z.allgather_partitions, z.allgather_bucket_size, z.round_robin_gradients) == (
        2, 10**8, True, False, False, 2 * 10**8, False, 3 * 10**8, True)
    assert c.aio == AioConfig(block_size=262144, queue_depth=32, intra_op_parallelism=4, single_submit=True,
                              overlap_events=False)
    assert c.offload == OffloadSectionConfig(daemon_socket="/run/x.sock", job_id="j1", host_memory_bytes=1 << 30,
                                             swap_capacity_bytes=1 << 34, checksum=False)


def test_integral_floats_are_integers_and_fractions_are_errors():
    c = read({"train_batch_size": 16.0, "zero_optimization": {"reduce_bucket_size": 5e8, "sub_group_size": 1e9,
                                                              "stage": 1.0}})
    assert c.batch.train_batch_size == 16 and type(c.batch.train_batch_size) is int
    assert c.zero.reduce_bucket_size == 500_000_000 and type(c.zero.reduce_bucket_size) is int
    assert c.zero.sub_group_size == 10**9 and c.zero.stage == 1 and type(c.zero.stage) is int
    with pytest.raises(ConfigError, match=r"zero_optimization\.allgather_bucket_size.*1\.5"):
        read(with_batch(zero_optimization={"allgather_bucket_size": 1.5}))


# ---- the batch triangle ----------------------------------------------------------------------

@pytest.mark.parametrize("train, micro, gas, world", [
    (64, 4, 8, 2), (64, 4, None, 2), (64, None, 8, 2), (None, 4, 8, 2),   # any two (or all three)
    (64, None, None, 4), (None, 4, None, 4),                              # one alone: DeepSpeed's rules
    (3, 3, 1, 1), (6, None, 2, 3),
])
def test_any_two_batch_keys_give_the_third(train, micro, gas, world):
    given = {k: v for k, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                               ("gradient_accumulation_steps", gas)) if v is not None}
    b = read(given, world_size=world).batch
    assert b.train_batch_size == b.micro_batch_size_per_gpu * b.gradient_accumulation_steps * world
    for mine, key in ((b.train_batch_size, train), (b.micro_batch_size_per_gpu, micro),
                      (b.gradient_accumulation_steps, gas)):
        assert key is None or mine == key
    if train is None or micro is None:  # one of train/micro alone: gas is 1 unless given
        assert b.gradient_accumulation_steps == (gas or 1)


@pytest.mark.parametrize("given, world", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2),
    ({"train_batch_size": 7}, 2),
])
def test_disagreeing_batch_sizes_name_every_value_and_the_world_size(given, world):
    with pytest.raises(ConfigError) as info:
        read(given, world_size=world)
    for key, value in given.items():
        assert f"{key}={value}" in str(info.value)
    assert f"world_size={world}" in str(info.value)


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 4}])
def test_neither_train_nor_micro_batch_is_an_error(given):
    with pytest.raises(ConfigError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        read(given)


def test_world_size_must_be_a_positive_integer():
    for bad in (0, -1, 1.0, True, None):
        with pytest.raises(ConfigError, match="world_size"):
            read_config({"train_batch_size": 8}, world_size=bad)


# ---- invalid values: each names its dotted key and the value ------------------------------------

BAD_VALUES = [
    ({"train_batch_size": -8}, "train_batch_size", "-8"),
    ({"train_batch_size": 0}, "train_batch_size", "0"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": -2}, "train_micro_batch_size_per_gpu", "-2"),
    ({"train_batch_size": [8]}, "train_batch_size", "[8]"),
    ({"train_batch_size": "8"}, "train_batch_size", "'8'"),
    (with_batch(zero_optimization={"stage": 4}), "zero_optimization.stage", "4"),
    (with_batch(zero_optimization={"stage": "1"}), "zero_optimization.stage", "'1'"),
    (with_batch(zero_optimization={"stage": True}), "zero_optimization.stage", "True"),
    (with_batch(zero_optimization={"sub_group_size": 0}), "zero_optimization.sub_group_size", "0"),
    (with_batch(zero_optimization={"overlap_comm": "true"}), "zero_optimization.overlap_comm", "'true'"),
    (with_batch(zero_optimization={"reduce_bucket_size": [1]}), "zero_optimization.reduce_bucket_size", "[1]"),
    (with_batch(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
     "zero_optimization.offload_optimizer.device", "'gpu'"),
    (with_batch(zero_optimization={"offload_optimizer": {"device": "nvme"}}),
     "zero_optimization.offload_optimizer.nvme_path", "None"),
    (with_batch(zero_optimization={"offload_param": {"device": "nvme"}}),
     "zero_optimization.offload_param.nvme_path", "None"),
    (with_batch(zero_optimization={"offload_optimizer": {"buffer_count": 0}}),
     "zero_optimization.offload_optimizer.buffer_count", "0"),
    (with_batch(zero_optimization={"offload_optimizer": {"ratio": 0.5}}),
     "zero_optimization.offload_optimizer.ratio", "0.5"),
    (with_batch(optimizer={"type": "Lamb"}), "optimizer.type", "'Lamb'"),
    (with_batch(optimizer={"type": "SGD", "params": {"lr": 0.1}}), "optimizer.type", "'SGD'"),
    (with_batch(optimizer={"type": "Adam", "params": {"lr": -1}}), "optimizer.params.lr", "-1"),
    (with_batch(optimizer={"type": "Adam", "params": {"betas": [0.9]}}), "optimizer.params.betas", "(0.9,)"),
    (with_batch(optimizer={"type": "Adam", "params": {"betas": [0.9, 1.0]}}), "optimizer.params.betas", "1.0"),
    (with_batch(optimizer={"type": "Adam", "params": {"eps": "1e-8"}}), "optimizer.params.eps", "'1e-8'"),
    (with_batch(optimizer={"type": "Adam", "params": {"amsgrad": True}}), "optimizer.params.amsgrad", "true"),
    (with_batch(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}),
     "optimizer.params.max_grad_norm", "1.0"),
    (with_batch(scheduler={"type": "OneCycle"}), "scheduler.type", "'OneCycle'"),
    (with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cubic"}}),
     "scheduler.params.warmup_type", "'cubic'"),
    (with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}}),
     "scheduler.params.warmup_num_steps", "0"),
    (with_batch(scheduler={"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}),
     "scheduler.params.total_num_steps", "None"),
    (with_batch(scheduler={"type": "WarmupLR", "params": {"total_num_steps": 10}}),
     "scheduler.params.total_num_steps", "WarmupLR"),
    (with_batch(fp16={"enabled": "true"}), "fp16.enabled", "'true'"),
    (with_batch(fp16={"hysteresis": 0}), "fp16.hysteresis", "0"),
    (with_batch(fp16={"loss_scale": -1}), "fp16.loss_scale", "-1"),
    (with_batch(fp16={"loss_scale_window": 0}), "fp16.loss_scale_window", "0"),
    (with_batch(fp16={"enabled": True}, bf16={"enabled": True}), "bf16.enabled", "enabled=True"),
    (with_batch(gradient_clipping=-1.0), "gradient_clipping", "-1.0"),
    (with_batch(steps_per_print=0), "steps_per_print", "0"),
    (with_batch(aio={"block_size": 1000}), "aio.block_size", "1000"),
    (with_batch(aio={"queue_depth": 0}), "aio.queue_depth", "0"),
    (with_batch(aio={"queue_depth": 1025}), "aio.queue_depth", "1025"),
    (with_batch(aio={"intra_op_parallelism": 65}), "aio.intra_op_parallelism", "65"),
    (with_batch(aio={"thread_count": 0}), "aio.thread_count", "0"),
    (with_batch(offload={"daemon_socket": ""}), "offload.daemon_socket", "''"),
    (with_batch(offload={"host_memory_bytes": 0}), "offload.host_memory_bytes", "0"),
    (with_batch(fp16=True), "fp16", "True"),
]


@pytest.mark.parametrize("cfg, key, value", BAD_VALUES, ids=[k for _, k, _ in BAD_VALUES])
def test_invalid_value_names_its_key_and_value(cfg, key, value):
    with pytest.raises(ConfigError) as info:
        read(cfg)
    assert isinstance(info.value, ValueError)
    assert key in str(info.value) and value in str(info.value)


def test_unknown_optimizer_type_lists_the_supported_ones():
    with pytest.raises(ConfigError, match=r"'Lamb'.*Adam.*AdamW"):
        read(with_batch(optimizer={"type": "Lamb"}))


# ---- nvme_path: exists, is a directory, is writable (checked by creating a file) ------------------

def test_nvme_needs_a_path_without_a_daemon_and_none_with_one(monkeypatch):
    """Through a node daemon the state swaps to the daemon's own paths: nvme_path may be left out (and is not
    probed); without one it is required, and the error says both ways out."""
    monkeypatch.delenv("OFFLOAD_DAEMON_SOCKET", raising=False)
    cfg = with_batch(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"},
                                        "offload_param": {"device": "nvme"}})
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path=None: set it .*or train through a node daemon"):
        read(cfg)
    assert read(dict(cfg, offload={"daemon_socket": "/nowhere/d.sock"})).zero.offload_optimizer.nvme_path is None
    monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", "/nowhere/d.sock")
    assert read(cfg).zero.offload_param.device is OffloadDevice.NVME


def test_nvme_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "no" / "such")
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path=.*no.*such.*no such directory"):
        read(with_batch(zero_optimization={"offload_optimizer": {"device": "nvme", "nvme_path": missing}}))


def test_nvme_path_that_is_a_file(tmp_path):
    file = tmp_path / "file"
    file.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"offload_param\.nvme_path=.*not a directory"):
        read(with_batch(zero_optimization={"offload_param": {"device": "nvme", "nvme_path": str(file)}}))


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory modes (os.access says yes); "
                    "the /proc test below covers the probe for root")
def test_nvme_path_without_write_permission(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path=.*not writable"):
        read(with_batch(zero_optimization={"offload_optimizer": {"device": "nvme", "nvme_path": str(ro)}}))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_nvme_path_on_a_file_system_that_refuses_new_files():
    # procfs takes no new files even from root, whose os.access() says every directory is writable:
    # only the real create-and-remove probe finds out.
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path='/proc'.*not writable"):
        read(with_batch(zero_optimization={"offload_optimizer": {"device": "nvme", "nvme_path": "/proc"}}))


def test_reading_is_pure_the_probe_leaves_nothing_and_nothing_is_imported(tmp_path, monkeypatch):
    work, nvme = tmp_path / "cwd", tmp_path / "nvme"
    work.mkdir()
    nvme.mkdir()
    monkeypatch.chdir(work)
    cfg = full_config(str(nvme))
    modules = set(sys.modules)
    c = read(cfg, world_size=2)
    assert c.zero.offload_optimizer.device is OffloadDevice.NVME
    with pytest.raises(ConfigError):
        read({**cfg, "zero_optimization": {**cfg["zero_optimization"], "stage": 4}}, world_size=2)
    assert set(sys.modules) == modules  # no torch, swap or daemon pulled in: nothing to allocate with
    assert list(nvme.iterdir()) == [] and list(work.iterdir()) == [] and sorted(tmp_path.iterdir()) == [work, nvme]


# ---- legacy and deprecated forms ------------------------------------------------------------------

def test_legacy_zero_optimization_true_and_false(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read(with_batch(zero_optimization=True)).zero == ZeroConfig(stage=1)
        assert read(with_batch(zero_optimization=True, allgather_size=5e7)).zero == ZeroConfig(
            stage=1, allgather_bucket_size=50_000_000)
        assert read(with_batch(zero_optimization=False)).zero == ZeroConfig(stage=0)
        assert read(with_batch(zero_optimization=False, allgather_size=5e7)).zero == ZeroConfig(stage=0)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("zero_optimization is deprecated" in m for m in messages) == 1
    assert sum("allgather_size" in m and "ignored" in m for m in messages) == 1


def test_cpu_offload_aliases_map_to_offload_sections(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        z = read(with_batch(zero_optimization={"stage": 2, "cpu_offload": True, "cpu_offload_param": True,
                                               "cpu_offload_use_pin_memory": False})).zero
    assert z.offload_optimizer == OffloadOptimizerConfig(device=OffloadDevice.CPU, pin_memory=False)
    assert z.offload_param == OffloadParamConfig(device=OffloadDevice.CPU, pin_memory=False)
    text = caplog.text
    for key in ("cpu_offload ", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        assert f"zero_optimization.{key}".strip() in text and "deprecated" in text
    assert read(with_batch(zero_optimization={"cpu_offload": False})).zero.offload_optimizer.device is (
        OffloadDevice.NONE)
    with pytest.raises(ConfigError, match="cpu_offload.*offload_optimizer.*both"):
        read(with_batch(zero_optimization={"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}))


def test_thread_count_is_the_older_intra_op_parallelism(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read(with_batch(aio={"thread_count": 4})).aio.intra_op_parallelism == 4
    assert "aio.thread_count is deprecated" in caplog.text
    assert read(with_batch(aio={"thread_count": 4, "intra_op_parallelism": 4})).aio.intra_op_parallelism == 4
    with pytest.raises(ConfigError, match=r"aio\.intra_op_parallelism=2 and aio\.thread_count=4"):
        read(with_batch(aio={"thread_count": 4, "intra_op_parallelism": 2}))


def test_bfloat16_is_the_older_bf16():
    assert read(with_batch(bfloat16={"enabled": True})).bf16.enabled is True
    with pytest.raises(ConfigError, match="bf16.*bfloat16"):
        read(with_batch(bf16={"enabled": True}, bfloat16={"enabled": True}))


def test_stage3_aliases_fill_one_field_and_must_agree():
    z = read(with_batch(zero_optimization={"stage": 3, "prefetch_bucket_size": 1e6})).zero
    assert z.stage3_prefetch_bucket_size == 1_000_000
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket_size=1000.*prefetch_bucket_size=2000"):
        read(with_batch(zero_optimization={"stage3_prefetch_bucket_size": 1000, "prefetch_bucket_size": 2000}))


# ---- "auto", unknown keys, ignored keys ----------------------------------------------------------

AUTO = [
    ({"train_batch_size": "auto"}, "train_batch_size"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
    (with_batch(gradient_clipping="auto"), "gradient_clipping"),
    (with_batch(optimizer={"type": "AdamW", "params": {"lr": "auto"}}), "optimizer.params.lr"),
    (with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}),
     "scheduler.params.warmup_max_lr"),
    (with_batch(fp16={"enabled": "auto"}), "fp16.enabled"),
    (with_batch(bf16={"enabled": "auto"}), "bf16.enabled"),
    (with_batch(zero_optimization={"reduce_bucket_size": "auto"}), "zero_optimization.reduce_bucket_size"),
    (with_batch(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": "auto"}),
     "zero_optimization.stage3_prefetch_bucket_size"),
]


@pytest.mark.parametrize("cfg, key", AUTO, ids=[k for _, k in AUTO])
def test_auto_must_be_resolved_by_the_caller(cfg, key):
    with pytest.raises(ConfigError, match=f'{key} is "auto"'):
        read(cfg)


UNKNOWN = [
    ({"trian_batch_size": 8}, "'trian_batch_size' at the top level", "train_batch_size"),
    (with_batch(stage=2), "'stage' at the top level", "zero_optimization.stage"),
    (with_batch(optimizer={"type": "Adam", "param": {}}), "'optimizer.param' in section 'optimizer'",
     "optimizer.params"),
    (with_batch(optimizer={"type": "Adam", "adam_w_mode": False}), "'optimizer.adam_w_mode'",
     "optimizer.params.adam_w_mode"),
    (with_batch(optimizer={"type": "Adam", "params": {"learning_rate": 1e-3}}),
     "'optimizer.params.learning_rate' in section 'optimizer.params'", None),
    (with_batch(optimizer={"type": "Adam", "params": {"weight_decy": 0.1}}), "'optimizer.params.weight_decy'",
     "optimizer.params.weight_decay"),
    (with_batch(scheduler={"type": "WarmupLR", "prams": {}}), "'scheduler.prams'", "scheduler.params"),
    (with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_max": 0.1}}), "'scheduler.params.warmup_max'",
     "scheduler.params.warmup_max_lr"),
    (with_batch(fp16={"enabled": True, "loss_scal": 0}), "'fp16.loss_scal'", "fp16.loss_scale"),
    (with_batch(bf16={"enable": True}), "'bf16.enable'", "bf16.enabled"),
    (with_batch(zero_optimization={"stag": 1}), "'zero_optimization.stag'", "zero_optimization.stage"),
    (with_batch(zero_optimization={"offload_optimizer": {"devise": "cpu"}}),
     "'zero_optimization.offload_optimizer.devise'", "zero_optimization.offload_optimizer.device"),
    (with_batch(zero_optimization={"offload_param": {"max_in_gpu": 1}}),
     "'zero_optimization.offload_param.max_in_gpu'", "zero_optimization.offload_param.max_in_cpu"),
    (with_batch(aio={"queue_deep": 8}), "'aio.queue_deep'", "aio.queue_depth"),
    (with_batch(offload={"daemon_sock": "/x"}), "'offload.daemon_sock'", "offload.daemon_socket"),
]


@pytest.mark.parametrize("cfg, where, suggestion", UNKNOWN, ids=[w for _, w, _ in UNKNOWN])
def test_unknown_key_names_its_dotted_path_and_the_closest_key(cfg, where, suggestion):
    with pytest.raises(ConfigError) as info:
        read(cfg)
    assert where in str(info.value)
    if suggestion is not None:
        assert f"did you mean {suggestion!r}" in str(info.value)


def test_ignored_keys_are_logged_once_by_dotted_name_and_not_read(caplog):
    cfg = with_batch(
        wandb={"enabled": "auto", "anything": [1, 2]},          # value not read: "auto" is fine here
        zero_allow_untested_optimizer=True,
        fp16={"enabled": True, "auto_cast": True},
        optimizer={"type": "Adam", "params": {"torch_adam": True}},
        zero_optimization={"stage": 2, "stage3_max_live_parameters": 1e9, "zero_quantized_weights": True,
                           "offload_optimizer": {"device": "cpu", "super_offload": False}},
        aio={"use_gds": False},
    )
    ignored = ["wandb", "zero_allow_untested_optimizer", "fp16.auto_cast", "optimizer.params.torch_adam",
               "zero_optimization.stage3_max_live_parameters", "zero_optimization.zero_quantized_weights",
               "zero_optimization.offload_optimizer.super_offload", "aio.use_gds"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = read(cfg)
        second = read(copy.deepcopy(cfg))
    assert first == second
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for key in ignored:
        assert sum(m.startswith(f"config key {key}:") and "ignored" in m for m in warned) == 1, key
    assert len(warned) == len(ignored)


def test_stage3_keys_are_used_not_ignored_at_stage_3(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        z = read(with_batch(zero_optimization={"stage": 3, "stage3_max_live_parameters": 1e8})).zero
    assert z.stage3_max_live_parameters == 10**8 and "ignored" not in caplog.text


# ---- optimizer and scheduler details ----------------------------------------------------------------

@pytest.mark.parametrize("section, kind, adamw_mode", [
    ({"type": "Adam"}, "adam", True),                                   # DeepSpeed's adam_w_mode default
    ({"type": "ADAM", "params": {"adam_w_mode": False}}, "adam", False),
    ({"type": "adamw"}, "adamw", True),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, "adamw", True),  # AdamW always decouples
])
def test_optimizer_type_and_weight_decay_mode(section, kind, adamw_mode):
    o = read(with_batch(optimizer=section)).optimizer
    assert (o.type, o.adamw_mode) == (kind, adamw_mode)


def test_warmup_lr_warms_up_to_the_optimizers_lr_unless_told():
    opt = {"type": "Adam", "params": {"lr": 0.02}}
    assert read(with_batch(optimizer=opt, scheduler={"type": "WarmupLR"})).scheduler.warmup_max_lr == 0.02
    told = {"type": "warmuplr", "params": {"warmup_max_lr": 0.5}}
    s = read(with_batch(optimizer=opt, scheduler=told)).scheduler
    assert (s.type, s.warmup_max_lr) == ("WarmupLR", 0.5)
    assert read(with_batch(scheduler={"type": "WarmupLR"})).scheduler.warmup_max_lr == 0.001


# ---- JSON files -----------------------------------------------------------------------------------

def test_json_file_reads_like_the_dict(tmp_path):
    cfg = full_config(str(tmp_path))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg, indent=2))
    assert read(str(path), world_size=2) == read(path, world_size=2) == read(cfg, world_size=2)


def test_json_syntax_error_names_the_file_line_and_column(tmp_path):
    lines = ['{', '  "train_batch_size": 8,', '  "fp16": {"enabled": true,}', '}']
    path = tmp_path / "bad.json"
    path.write_text("\n".join(lines))
    column = lines[2].index(",}") + 2  # 1-based column of the "}" after the trailing comma
    with pytest.raises(ConfigError, match=rf"{path}.*line 3, column {column}"):
        read(path)


@pytest.mark.parametrize("text, match", [
    ('{"train_batch_size": 8, "train_batch_size": 16}', "'train_batch_size' appears twice"),
    ('[1, 2]', "must be a JSON object"),
])
def test_json_file_shape_errors(tmp_path, text, match):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read(path)


def test_missing_json_file(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope.json'} not found"):
        read(str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="dict or the path"):
        read(42)


# ---- the dataclasses themselves, and the rest of the interface -------------------------------------

@pytest.mark.parametrize("build, field", [
    (lambda: ZeroConfig(stage=4), "ZeroConfig.stage"),
    (lambda: AioConfig(block_size=1000), "AioConfig.block_size"),
    (lambda: OffloadOptimizerConfig(device="gpu"), "OffloadOptimizerConfig.device"),
    (lambda: Fp16Config(hysteresis=0), "Fp16Config.hysteresis"),
    (lambda: OptimizerConfig(type="sgd"), "OptimizerConfig.type"),
    (lambda: SchedulerConfig(type="WarmupDecayLR"), "SchedulerConfig.total_num_steps"),
    (lambda: BatchConfig(train_batch_size=10, micro_batch_size_per_gpu=4, gradient_accumulation_steps=1),
     "BatchConfig.train_batch_size"),
])
def test_dataclasses_validate_when_built_by_hand(build, field):
    with pytest.raises(ConfigError, match=field) as info:
        build()
    assert info.value.field == field.split(".")[1]


def test_dataclasses_are_frozen_and_keyword_only():
    z = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        z.stage = 2
    with pytest.raises(TypeError):
        ZeroConfig(2)
    assert OffloadOptimizerConfig(device="CPU").device is OffloadDevice.CPU


def test_raw_is_a_read_only_copy():
    cfg = with_batch(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}, aio={})
    c = read(cfg)
    cfg["zero_optimization"]["stage"] = 2
    assert c.raw["zero_optimization"]["stage"] == 1
    with pytest.raises(TypeError):
        c.raw["zero_optimization"]["stage"] = 3
    assert isinstance(c, EngineConfig)


def test_raw_reads_back_to_the_same_config(tmp_path):
    c = read(full_config(str(tmp_path)), world_size=2)
    assert read(c.raw, world_size=2) == c  # e.g. a config kept in a checkpoint


def test_daemon_socket_and_job_id_resolution():
    empty, given = OffloadSectionConfig(), OffloadSectionConfig(daemon_socket="/a.sock", job_id="j")
    assert resolve_daemon_socket(empty, {}) is None
    assert resolve_daemon_socket(empty, {"OFFLOAD_DAEMON_SOCKET": "/env.sock"}) == "/env.sock"
    assert resolve_daemon_socket(given, {"OFFLOAD_DAEMON_SOCKET": "/env.sock"}) == "/a.sock"
    assert resolve_job_id(empty, {}) == "default"
    assert resolve_job_id(empty, {"TORCHELASTIC_RUN_ID": "run7"}) == "run7"
    assert resolve_job_id(given, {"TORCHELASTIC_RUN_ID": "run7"}) == "j"
