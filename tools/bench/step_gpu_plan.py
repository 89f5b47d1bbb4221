"""The GPU step bench's arithmetic, apart from any GPU: model FLOPs per step, the GPU's busy time
from a profile, which contenders fit in the memory at hand, and the largest GPT that does.

[Note: model FLOPs] Per token of a training step, ``6 N`` (forward 2 N, backward 4 N: every
parameter multiplies and adds once per token forward, twice backward; N counts a tied head's
weight once, and that weight's matmul is the head's) plus attention's ``12 L d T`` (the
``Q K^T`` and ``softmax V`` products, 2 x 2 L T d forward, twice that backward, with T the
sequence length and d the width), the PaLM paper's formula. The causal mask's saved half is
not subtracted (the common convention; FlashAttention skips those blocks, so the figure is
the model's work, not the kernels'). Achieved TFLOP/s = FLOPs per step / step seconds / 1e12.

[Note: GPU wait share] The share of a step the GPU's compute engine is idle: 1 - busy / step,
where busy is the union of the intervals of every CUDA kernel in one profiled step
(``torch.profiler``, CUDA activity; copy-engine work, ``Memcpy*`` and ``Memset*``, is not
compute and not counted, nor are the GPU-side spans of ``record_function`` ranges; overlapping
kernels on several streams count once) and step is the
median wall time of the timed, unprofiled steps (the profiler slows the host's launches, not
the kernels). Idle time is what the GPU spent waiting: for a fetch, for the host to launch,
for the CPU's optimizer step.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Sequence

logger = logging.getLogger(__name__)

__all__ = ["Contender", "CONTENDERS", "PEERS", "busy_seconds", "gpu_busy_seconds", "fits", "largest_layers",
           "model_flops_per_step"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contender:
    """One row of the bench: plain torch, or the engine with a ZeRO stage and offload choice."""

    name: str
    """The row's label (also what ``--contenders`` names)."""
    engine: bool = True
    """False: plain torch (fused AdamW on the GPU, autocast bf16)."""
    stage: int = 1
    """zero_optimization.stage."""
    optimizer: str = "none"
    """offload_optimizer.device."""
    param: str = "none"
    """offload_param.device (stage 3)."""
    delayed: bool = False
    """offload.delayed_update (after one ordinary step)."""
    overlap: bool | None = None
    """offload.overlap_step; None: the engine's default ("auto": on for offloaded stages 0-2 on a GPU)."""
    state_dtype: str = "fp32"
    """offload.state_dtype: how the offloaded Adam moments are stored ("fp32", "bf16", "int8")."""
    grad_accum_dtype: str = "fp32"
    """data_types.grad_accum_dtype: the host gradient accumulators' type ("fp32", "bf16")."""
    live_share: float | None = None
    """Stage 3: ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` at this share of the model's
    parameters (the GPU holding at most that much of it gathered at once)."""
    deepspeed: bool = False
    """DeepSpeed's engine on the same config keys (``step_deepspeed``), not ours."""
    under_forward: bool = False
    """offload.step_under_forward: the sub-groups left after backward stepped under the next forward."""
    ratio: float | None = None
    """``offload_optimizer.ratio``: the share of the optimizer offloaded, the rest on the GPU (ours at stages 0-2,
    DeepSpeed's at stage 3)."""


CONTENDERS = (
    Contender(name="torch", engine=False),
    Contender(name="none", stage=1),
    Contender(name="opt-cpu", stage=1, optimizer="cpu"),
    Contender(name="opt-cpu-serial", stage=1, optimizer="cpu", overlap=False),
    Contender(name="opt-cpu-fwd", stage=1, optimizer="cpu", under_forward=True),
    Contender(name="opt-cpu-half", stage=1, optimizer="cpu", under_forward=True, ratio=0.5),
    Contender(name="opt-nvme", stage=1, optimizer="nvme"),
    Contender(name="opt-cpu-dpu", stage=1, optimizer="cpu", delayed=True),
    Contender(name="opt-cpu-int8", stage=1, optimizer="cpu", state_dtype="int8"),
    Contender(name="opt-cpu-lean", stage=1, optimizer="cpu", state_dtype="int8", grad_accum_dtype="bf16"),
    Contender(name="s3-param-cpu", stage=3, optimizer="cpu", param="cpu"),
    Contender(name="s3-param-cpu-live25", stage=3, optimizer="cpu", param="cpu", live_share=0.25, overlap=True),
    Contender(name="s3-param-nvme", stage=3, optimizer="nvme", param="nvme"),
    Contender(name="ds-z2-opt-cpu", stage=2, optimizer="cpu", deepspeed=True),
    Contender(name="ds-z3-param-cpu", stage=3, optimizer="cpu", param="cpu", deepspeed=True),
)
"""Every row, in the order the bench prints them."""
PEERS = {"ds-z2-opt-cpu": "opt-cpu", "ds-z3-param-cpu": "s3-param-cpu"}
"""DeepSpeed's rows and ours each is held against (the same offload; ours at stage 1 moves what its stage 2
does with one rank)."""


def model_flops_per_step(*, params: int, n_layer: int, n_embd: int, seq: int, tokens: int) -> float:
    """[Note: model FLOPs] for ``tokens`` tokens of sequences of ``seq``."""
    return float(6 * params + 12 * n_layer * n_embd * seq) * tokens


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (any unit in, the same unit out)."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _is_kernel(event: Any, cuda: Any) -> bool:
    """A compute kernel on the GPU's timeline: not a copy-engine transfer, and not the GPU-side span of a
    ``record_function`` range (kineto's gpu_user_annotation), which covers the kernels inside it."""
    if event.device_type != cuda or event.name.startswith(("Memcpy", "Memset")):
        return False
    return not getattr(event, "is_user_annotation", False) and not event.name.startswith(("offload::", "ProfilerStep"))


def gpu_busy_seconds(prof: Any) -> float | None:
    """Seconds some CUDA kernel ran in a ``torch.profiler.profile`` ([Note: GPU wait share]); None if it
    recorded no kernel (no GPU, or a profiler that sees none)."""
    from torch.autograd import DeviceType

    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if _is_kernel(e, DeviceType.CUDA)]
    if not spans:
        return None
    return busy_seconds(spans) / 1e6  # the profiler's times are microseconds


def _estimate_row(c: Contender, *, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int, batch: int,
                  host_budget_bytes: int | None, baseline_bytes: int):
    from offload.plan.estimate import EstimateInput, estimate, gpt_shapes

    shapes = gpt_shapes(vocab_size=vocab, n_layer=n_layer, n_embd=n_embd, seq=seq, batch=batch, n_head=n_head)
    inp = EstimateInput(shapes=shapes, compute_bytes=2, sub_group_size=100_000_000,
                        host_memory_bytes=host_budget_bytes, baseline_bytes=baseline_bytes)
    # Built on the host in fp32 first (stage 3 under init_context builds nothing there): the model, and the
    # engine's fp32 masters copied from it at start, held at once for a moment.
    start_bytes = 0 if c.stage == 3 else (4 if not c.engine else 8) * shapes.params
    if not c.engine:  # plain torch AMP (fp32 params, grads, moments: 16 B/param, plus autocast's bf16 weight
        row = estimate(inp, stages=(0,)).row(stage=0, optimizer="none")  # copies): the engine's 20 B/param row
    else:
        row = estimate(inp, stages=(c.stage,)).row(stage=c.stage, optimizer=c.optimizer, param=c.param)
    row = dataclasses.replace(row, host_bytes=row.host_bytes + start_bytes)
    if c.delayed:  # a second fp32 gradient accumulator and a bf16 staging copy ([Note: delayed update])
        row = dataclasses.replace(row, host_bytes=row.host_bytes + 6 * shapes.params)
    return row


def fits(c: Contender, *, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int, batch: int,
         device_bytes: int, host_bytes: int, nvme_bytes: int, headroom: float = 0.85,
         baseline_bytes: int = 0) -> tuple[bool, str]:
    """Whether ``offload estimate`` puts contender ``c`` inside ``headroom`` of each memory; and why not."""
    row = _estimate_row(c, n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab, seq=seq, batch=batch,
                        host_budget_bytes=int(headroom * host_bytes), baseline_bytes=baseline_bytes)
    short = [f"{what} {need / 2**30:.1f} GiB > {headroom:.0%} of {have / 2**30:.1f} GiB"
             for what, need, have in (("device", row.device_bytes, device_bytes), ("host", row.host_bytes, host_bytes),
                                      ("nvme", row.nvme_bytes, nvme_bytes))
             if need > headroom * have]
    return not short, "; ".join(short)


def largest_layers(contenders: Sequence[Contender], *, n_embd: int, n_head: int, vocab: int, seq: int, batch: int,
                   device_bytes: int, host_bytes: int, nvme_bytes: int, headroom: float = 0.85,
                   baseline_bytes: int = 0, most: int = 1024) -> int:
    """The most layers (at width ``n_embd``) with which at least one of ``contenders`` fits; 0 if none does
    with one layer. What a contender needs grows with the layer count: a binary search."""
    def ok(n: int) -> bool:
        return any(fits(c, n_layer=n, n_embd=n_embd, n_head=n_head, vocab=vocab, seq=seq, batch=batch,
                        device_bytes=device_bytes, host_bytes=host_bytes, nvme_bytes=nvme_bytes, headroom=headroom,
                        baseline_bytes=baseline_bytes)[0] for c in contenders)

    if not ok(1):
        return 0
    lo, hi = 1, most
    if ok(hi):
        return hi
    while hi - lo > 1:  # ok(lo) and not ok(hi)
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
