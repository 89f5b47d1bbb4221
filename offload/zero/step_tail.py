"""The optimizer step's tail under the next forward: ``offload.step_under_forward``.

[Note: the step under the next forward] The overlapped step ([Note: overlapped step] in offload.zero.overlap)
hides the CPU's Adam for the sub-groups whose gradients are complete before backward ends; the rest, the
sub-groups of the first layers (cut last: [Note: flat layout]), was stepped after backward, and the next
forward waited for the whole of it. Those are the sub-groups the next forward needs first, so stepping them
first, in the order the forward reaches them, lets that forward start as soon as its first modules' params
are back:
1. at ``engine.step()`` the verdict is known (the clip, the overflow), so nothing here is speculative: the
   device's share ([Note: GPU-resident share] in offload.zero.device_share) is enqueued, and the sub-groups
   left are handed to the overlap's worker thread in the order of the modules' first forward, as its hooks
   saw them fire (the sub-groups no hook names after, highest first); each one's params start for the device
   as soon as it is stepped ([Note: publish as stepped] in offload.zero.optimizer); ``step()`` returns at once;
2. a forward pre-hook on every module that owns trainable params waits, on the host, until the worker has
   stepped every sub-group up to the last one of that module's params in the stepping order, a prefix of it,
   then makes the compute stream wait for those sub-groups' copies, and only then runs the module. The waits
   only grow along the order, so a param a module reads of a module that ran before it (a tied embedding) is
   in; the order is only what makes the waits short, never what makes them right;
3. the next backward, ``engine.step()``, a checkpoint, ``save_16bit_model`` and ``engine.settle()`` first
   wait for the rest (the worker reads the gradient accumulators the next backward lands into) and publish it.
The Adam passes are the ordinary step's (the same sub-groups, multiplier and plan, each once); only their
order and the thread differ, so the result is the serial step's, bit for bit.

What it changes, and why it is off by default: between ``engine.step()`` and the next forward (or
``engine.settle()``) the model's params are not all the step's yet. A script that reads them there (an
EMA of the weights, a norm logged after the step, ``model.state_dict()`` by hand) reads a mixture; it must
call ``engine.settle()`` first. The forward itself, the engine's checkpoints and saves are exact. A module
that reads a param registered after it, before that param's own module has run, would also read it early:
such reads are rare (stage 3 names them too: [Note: external parameters] in offload.zero.external).

[Note: the window at 1B] What the schedule can hide, from the H200 figures of the ~1B GPT in step_gpu.py
(tools/bench/results/gpu_h200_202611.md: 1.012B params, 4 micro-batches of 8 x 1024 tokens, no offload 0.424 s
a step, so ~35 ms of forward and ~71 ms of backward a micro-batch; the offloaded step 0.756 s): the offloaded
part is ~0.33 s, of which the CPU's Adam is ~0.19 s (10 sub-groups of 100M, ~19 ms each), the gradients out and
the params back 2 GB each way at ~55 GB/s (~37 ms each, on their own streams). Only two windows can hold the
Adam: the last micro-batch's backward (~71 ms, less the ~10 ms until the first sub-group has landed) and the
next step's *first* forward (~35 ms: it needs every param by its end; the three micro-batches after it need
nothing new). Under backward, each early sub-group cost its Adam pass plus its rollback copy (1.1-1.7x the pass):
~1.5 sub-groups fitted; with the copies made ahead ([Note: copies ahead] in offload.zero.overlap) ~3 do. Under
the forward, its modules run at the pace the CPU delivers their sub-groups. So of ~190 ms of Adam about 95 are
hidden and the step is about none's + 0.10-0.12 s, 0.80-0.85 of torch's rate (0.460 s) at best: the bar of 0.80
is at the edge at this size, and it is the size that is hard (the windows grow with the model's compute per
param, the Adam does not: at 8B, a micro-batch of 8 x 4096 tokens is ~32x the compute for 8x the params). With
half of the state on the GPU (``offload_optimizer.ratio`` 0.5) the CPU's Adam is ~95 ms, about what the two
windows hold, and the GPU's half is ~5 ms of its fused AdamW: 0.90 of torch is within reach. Measured figures,
when a GPU is lent: ``tools/gpu_check.sh step`` (rows opt-cpu-fwd and opt-cpu-half, with the per-step
breakdown of what ran under backward and under forward).

Where it does not run (logged once): where the step all-gathers the shards after it (stages 1-2 on several
ranks: the gather is the wait), node-shared buffers, a daemon's step record (its progress is written as
each sub-group is stepped, on the caller's thread).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import torch

from offload.zero.optimizer import PartitionedAdam, StepPlan

logger = logging.getLogger(__name__)

__all__ = ["StepTail", "attach_tail"]


def attach_tail(overlap: Any, adam: PartitionedAdam, module: torch.nn.Module, params: Sequence[torch.nn.Parameter], *,
                recorded: bool) -> "StepTail | None":
    """``offload.step_under_forward``: a tail over ``adam`` given to ``overlap`` (``OverlappedStep``) where it can
    run; else None, the log saying why (``recorded``: a node daemon records the steps)."""
    why = ("the overlapped step is off (offload.overlap_step \"auto\" on a CPU model)" if overlap is None
           else _unavailable(adam, recorded=recorded))
    if why is not None:
        logger.warning("offload.step_under_forward: off (%s); the next forward waits for the whole step", why)
        return None
    overlap.tail = StepTail(adam, module, params, overlap.pool)
    return overlap.tail


def _unavailable(adam: PartitionedAdam, *, recorded: bool) -> str | None:
    """Why the step's tail cannot run under the next forward with this optimizer (None: it can)."""
    if adam.gather:
        return "the shards are all-gathered after the step (stages 1-2 over several ranks)"
    if adam._node is not None:
        return "the ranks share their param buffer (node-shared buffers)"
    if adam._params_out is not None:
        return "stage 3 writes the param shards in place"
    if recorded:
        return "a node daemon records each step's progress"
    return None


class StepTail:
    """The sub-groups a step has left, stepped on the overlap's worker while the next forward runs, each
    module of that forward waiting for its own ([Note: the step under the next forward])."""

    def __init__(self, adam: PartitionedAdam, module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                 pool: Any) -> None:
        """``params``: the layout's, in slot order; ``pool``: the overlap's one-thread executor."""
        self.adam = adam
        self._pool = pool
        layout = adam.layout
        sgs_of_slot: list[set[int]] = [set() for _ in layout.slots]
        for sg in layout.sub_groups:
            for piece in sg.pieces:
                for slot, _, _, _ in layout.param_runs(piece):
                    sgs_of_slot[slot.index].add(sg.index)
        slot_of = {id(p): i for i, p in enumerate(params)}
        self._handles = []
        self._names: list[str] = []
        self._sgs_of_hook: list[frozenset[int]] = []
        for name, m in module.named_modules():
            own = set()
            for p in m.parameters(recurse=False):
                if id(p) in slot_of:
                    own |= sgs_of_slot[slot_of[id(p)]]
            if own:
                self._sgs_of_hook.append(frozenset(own))
                self._names.append(name or "<root>")
                hook = self._waiter(len(self._sgs_of_hook) - 1, name or "<root>")
                self._handles.append(m.register_forward_pre_hook(hook))
        self._trace: list[int] = []  # hooks in the order the first forward fired them
        self._tracing = True
        self._cond = threading.Condition()
        self._order: list[int] = []
        self._pos: dict[int, int] = {}
        self._pending: list[Any] = []  # per position: the copies its publish started (None: copied already)
        self._done = 0  # positions stepped and published
        self._waited = 0  # positions the compute stream waits for already
        self._error: BaseException | None = None
        self._future = None
        self.active = False
        self.waits: list[tuple[str, int]] = []
        """The forward under the last step's tail, each module that had to wait: (its name, the positions of the
        stepping order it needed done)."""
        self.last_waits: list[tuple[str, int]] = []
        """``waits`` of the tail before (``start`` moves them here)."""
        self.sub_groups_under_forward = 0
        """Sub-groups handed to the worker after ``engine.step()`` returned, since the start."""
        self.wait_seconds = 0.0
        """Host time the forward's modules waited for the worker, since the start."""

    @property
    def busy(self) -> bool:
        return self.active

    @property
    def forward_order(self) -> list[str]:
        """The modules owning trainable params, in the order the first forward reached them."""
        return [self._names[k] for k in self._trace]

    def order(self, sgs: set[int] | frozenset[int]) -> list[int]:
        """``sgs`` in the order the first forward needs them (those no hook names after, highest first)."""
        out: list[int] = []
        for k in self._trace:
            out.extend(sorted((s for s in self._sgs_of_hook[k] if s in sgs and s not in out), reverse=True))
        return out + sorted(set(sgs) - set(out), reverse=True)

    def start(self, sgs: set[int] | frozenset[int], grad_multiplier: float, plan: StepPlan) -> None:
        """Step ``sgs`` on the worker, in the forward's order (``order``), publishing each as it is done."""
        self._tracing = False
        self._order = self.order(sgs)
        self._pos = {sg: k for k, sg in enumerate(self._order)}
        self._pending = [None] * len(self._order)
        self._done = self._waited = 0
        self._error = None
        self.last_waits, self.waits = self.waits, []
        self.active = True
        self.sub_groups_under_forward += len(self._order)
        self._future = self._pool.submit(self._run, grad_multiplier, plan)

    def _run(self, mult: float, plan: StepPlan) -> None:  # on the worker thread
        try:
            self.adam.step_states(mult, plan, order=self._order, publish_early=True, stepped=self._stepped)
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            raise

    def _stepped(self, sg: int, pending: Any) -> None:  # on the worker thread
        with self._cond:
            self._pending[self._pos[sg]] = pending
            self._done = self._pos[sg] + 1
            self._cond.notify_all()

    def _waiter(self, k: int, name: str):
        sgs = self._sgs_of_hook[k]

        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            if self._tracing and k not in self._trace:
                self._trace.append(k)
            if not self.active:
                return
            need = max((self._pos[s] for s in sgs if s in self._pos), default=-1) + 1
            if need <= self._waited:
                return
            t0 = time.perf_counter()
            with self._cond:
                while self._done < need and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
            for pending in self._pending[self._waited:need]:
                if pending is not None:
                    self.adam._fetcher.wait_fetch(pending)  # the compute stream, not the host
            self._waited = need
            self.wait_seconds += time.perf_counter() - t0
            self.waits.append((name, need))
        return pre_forward

    def finish(self) -> None:
        """Wait for the rest of the step and publish it (the compute stream waits for every copy)."""
        if not self.active:
            return
        self.active = False
        future, self._future = self._future, None
        future.result()
        self.adam.publish()

    def remove_hooks(self) -> None:
        """The forward's pre-hooks off the model (the engine is closing)."""
        for h in self._handles:
            h.remove()
        self._handles = []
