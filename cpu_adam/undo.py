"""The undo-logged Adam step: every call into ``csrc._adam``'s undo log is here.

``UndoLog`` is a buffer (the node daemon's shared memory, in the engine) that the C pass keeps
its undo record in ([Note: undo log] in ``csrc/adam_undo.c``): a process killed inside the
pass leaves what its restart needs to finish the pass bit for bit. A pass is a sequence of
calls (``step``), numbered from 0 after ``begin``; a restart calls ``begin`` no more, and
makes the same calls again with ``resume=True``.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from cpu_adam.kernels import (AdamConfig, _collect, _template, build_tensors, default_num_threads, dtype_code,
                              ffi, lib)
from csrc import ConfigError, raise_errno

logger = logging.getLogger(__name__)

__all__ = ["UndoLog", "undo_bytes"]

SUB_ELEMS = lib.OFL_UNDO_SUB_ELEMS


def undo_bytes(slots: int, max_elems: int) -> int:
    """Bytes of an undo log with ``slots`` thread slots for calls of up to ``max_elems`` elements."""
    n = lib.ofl_adam_undo_bytes(slots, max_elems)
    if n < 0:
        raise ConfigError(f"an undo log needs 1-256 slots and max_elems >= 0, got {slots} and {max_elems}")
    return int(n)


class UndoLog:
    """An undo log over a writable buffer (a memoryview of shared memory, say), 64-byte aligned."""

    def __init__(self, buffer, *, fresh: bool, slots: int | None = None, max_elems: int = 0) -> None:
        """``fresh``: lay it out for ``slots`` threads (default: the cores this process may run on) and
        calls of up to ``max_elems`` elements; else adopt the log a previous process left in it."""
        self._cbuf = ffi.from_buffer(buffer, require_writable=True)
        self._keep = buffer
        self.nbytes = len(self._cbuf)
        if fresh:
            raise_errno(lib.ofl_adam_undo_init(self._cbuf, self.nbytes, slots or default_num_threads(), max_elems),
                        "ofl_adam_undo_init")

    def begin(self) -> None:
        """A new pass: none of its calls is done."""
        raise_errno(lib.ofl_adam_undo_begin(self._cbuf, self.nbytes), "ofl_adam_undo_begin")

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
             exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], *, config: AdamConfig,
             call: int, resume: bool = False, grad_scale: float = 1.0,
             params_out: Sequence[torch.Tensor] | None = None) -> int:
        """``cpu_adam.adam_step`` as call ``call`` of the pass, logged; returns how many half-written
        pieces a resumed call restored."""
        n = len(params)
        if any(len(s) != n for s in (grads, exp_avgs, exp_avg_sqs, steps)) or (
                params_out is not None and len(params_out) != n):
            raise ConfigError("params, grads, exp_avgs, exp_avg_sqs, steps (and params_out) differ in length")
        if n == 0:
            return 0
        grad_code = dtype_code(grads, "grads")
        out_code = dtype_code(params_out, "params_out") if params_out is not None else lib.OFL_DTYPE_NONE
        tensors = build_tensors(*_collect(params, grads, exp_avgs, exp_avg_sqs, steps, params_out))
        cfg = ffi.new("ofl_adam_config *", _template(config)[0])
        cfg.grad_scale = grad_scale
        cfg.grad_dtype = grad_code
        cfg.out_dtype = out_code
        cfg.num_threads = config.num_threads or default_num_threads()
        nonfinite = ffi.new("int32_t *")
        restored = ffi.new("int64_t *")
        rc = lib.ofl_adam_step_undo(cfg, tensors[0], self._cbuf, self.nbytes, call, int(resume), nonfinite, restored)
        raise_errno(rc, "ofl_adam_step_undo")
        return int(restored[0])

    def release(self) -> None:
        self._cbuf = None
        self._keep = None


def arm_fault_for_tests(call: int, chunk: int, offset: int) -> None:
    """Tests only: SIGKILL this process halfway through the piece at element ``offset`` of chunk
    ``chunk`` (65536 elements each) of call ``call`` of the next logged pass that reaches it."""
    lib.ofl_adam_undo_fault(call, chunk, offset)
