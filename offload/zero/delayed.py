"""The one-step delayed parameter update (DPU) of the ZeRO-Offload paper: the CPU's Adam step
of step t runs while forward and backward of step t+1 run, so neither waits for the other.

[Note: delayed update] With ``offload.delayed_update`` on, after
``delayed_update_warmup_steps`` ordinary steps, the engine's step at the boundary of step t:
1. waits for the step started at t-1 (if any) and publishes its params into the model;
2. checks step t's gradient (overflow, global norm) on this thread, as an ordinary step does;
3. fixes what the step reads (step number, each group's LR and betas, the gradient
   accumulators: ``PartitionedAdam.prepare_step``), swaps in a second set of accumulators
   for step t+1's gradients to land in, and starts the Adam pass over the states on a
   background thread, writing the new params to a staging buffer, not the model;
4. returns: step t+1's forward and backward run with the params of step t-1's update.
So the update computed from step t's gradient is in the params step t+2 computes with:
every gradient is one step stale, which is the whole price. The paper turns it on after a
few dozen steps, when the gradients change slowly; before that the steps are ordinary.

What this costs in memory: a second fp32 gradient accumulator per sub-group (4 bytes per
parameter of the partition, plain host memory) and a staging copy of the partition's
params in the compute dtype.

What waits for the step in flight: the next step boundary (1. above), checkpoints, a
commit to the daemon (the committed masters are the finished step's; the params a resume
rebuilds from them are one update ahead of those this process computed with), and close.
Collectives (the params' all-gather over ranks) stay on the training thread, in publish,
so every rank issues them in the same order.

Its effect on the loss (``tools/bench/results/dpu-loss_2core-kvm_202611.md``), from
``tools/bench/bench_dpu_loss.py --steps 300 --warmup 20|100 --every 30``: the demo GPT at
lr 3e-3, ordinary against delayed after 20 / 100 steps, mean loss over steps 271-300
2.097 / 2.608 / 2.442, held-out 2.053 / 2.604 / 2.427 (at lr 1e-3, warm-up 100: held-out
2.146 ordinary, 2.337 delayed). One stale step costs this small model a lot; judge it on the
curve of the model at hand.

With the daemon, a kill while the background pass runs leaves a torn state (refused, naming the
last checkpoint), not one a restart finishes ([Note: restartable step] in offload.checkpoint.resume): every
other step the pass reads the spare gradient set, which is this process's memory, not a daemon
region; and a delayed run resumed from the daemon is not bit-equal to the uninterrupted one even
between steps (above: the params rebuilt from the masters are one update ahead), so finishing the
step (spare set as daemon regions, the record written before ``start``) would buy a resume, not
exactness.

Not yet: stage 3 (the update writes the param shards the hooks gather from), and a step
whose state is on the GPU (offload_optimizer none: nothing to overlap).
"""
from __future__ import annotations

import concurrent.futures
import logging

import torch

from csrc import ConfigError
from offload.zero.optimizer import PartitionedAdam

logger = logging.getLogger(__name__)

__all__ = ["DelayedUpdate"]


class DelayedUpdate:
    """Runs ``PartitionedAdam``'s steps one step late on a background thread ([Note: delayed update])."""

    def __init__(self, adam: PartitionedAdam, *, warmup_steps: int) -> None:
        if not adam._on_host:
            raise ConfigError("offload.delayed_update needs the optimizer state offloaded "
                              "(zero_optimization.offload_optimizer.device cpu or nvme)")
        if warmup_steps < 0:
            raise ConfigError(f"offload.delayed_update_warmup_steps must be >= 0, got {warmup_steps}")
        self.adam = adam
        self.warmup_steps = warmup_steps
        adam.use_staging()
        self._spare = [torch.zeros(sg.numel, dtype=torch.float32) for sg in adam.layout.sub_groups]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-dpu")
        self._future: concurrent.futures.Future | None = None
        self._unpublished = False
        self.delayed_steps = 0
        """Steps started in the background so far."""

    @property
    def busy(self) -> bool:
        """A step is running (or finished and not waited for)."""
        return self._future is not None

    def applies(self) -> bool:
        """Whether the next step is delayed (the warm-up is over)."""
        return self.adam.step_count >= self.warmup_steps

    def start(self, grad_multiplier: float) -> None:
        """Start the step of the gradients accumulated so far; the next ones land in the other set."""
        self.publish()
        grads = self.adam.storage.swap_grads(self._spare)
        plan = self.adam.prepare_step(grads)
        self._spare = grads
        self._future = self._pool.submit(self.adam.step_states, grad_multiplier, plan)
        self._unpublished = True
        self.delayed_steps += 1

    def finish(self) -> None:
        """Wait for the step in flight (its error, if it failed, is raised here)."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def publish(self) -> None:
        """Wait for the step in flight and bring its params into the model."""
        self.finish()
        if self._unpublished:
            self._unpublished = False
            self.adam.publish()

    def discard(self) -> None:
        """Wait for the step in flight and drop its params (the model's are about to be replaced)."""
        self.finish()
        self._unpublished = False

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self._pool.shutdown(wait=True)
