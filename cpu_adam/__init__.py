"""SIMD CPU Adam: ``CPUAdam``/``CPUAdamW`` optimizers and the functional step the engine calls.

The kernels are C (AVX-512, AVX2+FMA+F16C, scalar; chosen at run time), compiled by
cffi at install; see ``csrc/ofl_adam.h``.
"""
from cpu_adam.kernels import (
    AdamConfig,
    Isa,
    adam_step,
    available_isas,
    default_num_threads,
    grad_land,
    grad_sumsq,
    resolve_isa,
)
from cpu_adam.optimizer import CPUAdam, CPUAdamW
from cpu_adam.plan import AdamPlan
from cpu_adam.threads import set_thread_source, team_stats, thread_source

__all__ = [
    "AdamConfig",
    "AdamPlan",
    "CPUAdam",
    "CPUAdamW",
    "Isa",
    "adam_step",
    "available_isas",
    "default_num_threads",
    "grad_land",
    "grad_sumsq",
    "resolve_isa",
    "set_thread_source",
    "team_stats",
    "thread_source",
]
