"""The optimizer step overlapped with backward: a sub-group whose gradients have all landed is
stepped by CPU Adam on a background thread while backward still runs on earlier layers
(``offload.overlap_step``; SuperOffload's "speculation then validation", made exact).

[Note: overlapped step] Sub-groups are cut from the partition in bucket order, and buckets in
the order backward produces their gradients ([Note: flat layout]), so at an accumulation
boundary the first sub-groups' gradients are complete long before backward ends. Stepping
them then needs two numbers that depend on every gradient: the clip coefficient (the global
norm) and the verdict of the overflow check (a non-finite gradient skips the step, in fp16
and, as in the ordinary path, in bf16 and fp32 too). So the early steps are speculative:
1. as the boundary's backward begins, fix what the step reads (``prepare_step(count=False)``:
   step number, each group's LR and betas) and the multiplier of an unclipped step,
   ``1 / (loss_scale * world_size)``;
2. when a sub-group's last bucket lands (``PartitionedAdam.landed``), and the partial sum of
   squares landed so far is finite and does not already clip (it only grows, so a partial
   norm over ``gradient_clipping`` means the step will clip: speculation stops for this step),
   keep what undoing it needs and step it on the worker thread; the new params go to the
   staging buffer (never the params backward is reading), published after the step;
3. at ``engine.step()``: wait for the worker; if the step is skipped (overflow), or its real
   multiplier, step number or hyperparameters differ in any bit from the speculated ones
   (clipping, a changed LR), restore the early sub-groups exactly and step everything as the
   ordinary path does; otherwise step only the sub-groups left. Either way every sub-group is
   stepped once with the ordinary path's multiplier and plan, from the same state: the result
   is bit for bit the ordinary step's.
What undoing keeps: with ``offload_optimizer`` cpu, a copy of each early sub-group's state block
(master, exp_avg, exp_avg_sq: 12 bytes per element, plain host memory kept for the next step;
a copy takes 1.1-1.7x as long as the Adam pass over the same block: ``tools/bench/bench_rollback_copy.py``,
figures in ``tools/bench/results/step-overlap_2core-epyc_202611.md``; so they are made ahead, after the
step before, not under backward: [Note: copies ahead]). The copies are bounded: at most
as many early sub-groups per step as their copies fit in the share of available memory the
nvme window takes (``copies_that_fit``; 1/2 of MemAvailable over the node's ranks), never
fewer than MIN_COPIES; the rest is stepped after backward. With nvme, nothing: the early
blocks stay in host memory unmarked until the verdict, so NVMe still holds their state from
before the step; a rollback drops the host copies unwritten and reads them again, and a
commit marks them dirty and evicts them. At most ``window - 1`` blocks are stepped early with nvme
(those prefetched as backward began), so the rest of the step still has room to pipeline.
With the daemon, the step-in-progress marker is set as the boundary's backward begins, not at
``engine.step()``, and a process that dies under backward is rolled back by its restart, not
finished: finishing would need the gradients not yet landed (on the GPU or in the reducer's
buffers, gone with the process) and the real multiplier (the global norm). So the rollback copies
are daemon regions then (``engine.rollback.<k>``), each recorded once whole, and with nvme the
pre-step state is NVMe's; after the verdict the step is an ordinary recorded one whose early
sub-groups count as done ([Note: speculative step] in offload.checkpoint.resume).
SuperOffload instead undoes a step algebraically (its ``adam_rollback``), which is not exact
in floating point; a copy is.
Besides: the params are staged (a copy of the partition in the compute dtype, as the delayed
update's; a GPU model has it anyway), and buckets are cut no larger than a sub-group
(``offload.builder``), or a 50M-element bucket would complete a dozen sub-groups at once.
On a CPU-only machine it does not pay: backward and the worker share the cores, and the
~100M GPT's step is 0.93-1.09x the ordinary one's on 2 cores (the results file above).

[Note: landing early] With one rank on the CPU a bucket lands in its reduce hook, during
backward. Where it is reduced across ranks (or copied off a GPU), it used to land after
backward; with the overlap on, the reducer lands finished reductions (``Work.is_completed``, a
copy's event) from the hooks, oldest first and stopping at the first unfinished one, so the
landing order, and with it the sum of squares, is the one it lands in after backward. (gloo's
reduce-scatter reports completion only once waited for, so with gloo, stages 1-2 land only as
``end`` waits for each reduction in turn; its all-reduce (stage 0) and NCCL's collectives report it.)

[Note: the host runs ahead] Why the overlapped step gained nothing on a GPU (0.56 of torch's rate
at ~1B on an H200, as the serial step), found from the code: on a GPU, autograd's backward
*enqueues* kernels, and the host walks the graph, firing the hooks, far ahead of them (at 1B a
micro-batch's backward is ~70 ms of GPU work; the host's share, not yet measured, is what step_gpu's
per-step breakdown shows as "backward s"). So when a hook asked
whether an earlier bucket's copy to the host had finished (its event), the GPU had not yet run
that bucket's backward: nothing ever landed in a hook. ``backward()`` returned at once, and the
watch was disarmed (``backward_done``) before ``reducer.end()``, which waited for every copy and
landed them all: no sub-group was ever stepped early, and the whole CPU Adam ran after the GPU's
backward, as in the serial step. Now the watch stays armed through ``end()``, which waits for each
bucket's copy in the order backward produces them and lands it as soon as it is in: a sub-group
whose last bucket is in starts on the worker while the host waits for the next copy and the GPU
runs the rest of backward. The window is then the GPU's backward after the first sub-group
completes (at 1B with 4 micro-batches, most of the last micro-batch's ~70 ms), less the rollback
copies' share (1.1-1.7x an Adam pass over the same block). ``backward_done`` now marks the end of
the last landing, so ``seconds_under_backward`` counts the time under the GPU's backward.

What is left after backward (the first layers' sub-groups, complete last) is stepped after it, and the next
forward waits for all of it; with ``offload.step_under_forward`` it is stepped under that forward instead,
each module waiting for its own ([Note: the step under the next forward] in offload.zero.step_tail); and with
``offload_optimizer.ratio`` below 1 the device keeps those sub-groups ([Note: GPU-resident share] in
offload.zero.device_share), whose Adam the GPU runs under the CPU's.

At stage 3 it runs where ``overlap_step`` is true ("auto" leaves it off there): the early sub-groups'
params wait in buffers of their own until the verdict ([Note: early steps at stage 3]). Not supported:
the state on the GPU (``offload_optimizer`` none: nothing to overlap), and ``offload.delayed_update``
(which overlaps the whole step already): ``true`` there is a ConfigError, "auto" is off.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import time

import torch

from csrc import ConfigError, QuotaExceededError, TierFullError
from offload.precision import clip_coefficient
from offload.checkpoint.resume import MAX_EARLY, ROLLBACK_NAME
from offload.zero.layout import Bucket
from offload.zero.optimizer import PartitionedAdam, StepPlan
from offload.zero.states import F32
from offload.plan.budget import window_size

logger = logging.getLogger(__name__)

__all__ = ["OverlappedStep", "copies_that_fit", "overlap_runs", "overlap_wanted"]

MIN_COPIES = 2
"""Sub-groups stepped early per step with the state in host memory, whatever the memory says."""


def overlap_wanted(setting: bool | str, *, device_type: str, stage: int, offloaded: bool, delayed: bool,
                   log: bool = True) -> bool:
    """Whether ``offload.overlap_step`` is on. "auto": where the model computes on a GPU (on a
    CPU-only machine backward and Adam would compete for the same cores), with the optimizer
    state offloaded, stages 0-2 and no delayed update; a GPU run it turns off says why, once
    (``log``: the estimate, which asks per row, does not).
    ``True`` in an unsupported combination was refused when the config was read."""
    if setting is True:
        return True
    if setting != "auto":
        return False
    if device_type != "cuda":
        if log:
            logger.debug("offload.overlap_step auto: off (the model computes on the CPU)")
        return False
    reason = ("offload.delayed_update is on" if delayed else
              "the optimizer state is not offloaded" if not offloaded else
              "zero_optimization.stage 3: offload.overlap_step true turns it on" if stage == 3 else None)
    if reason is not None:
        if log:
            logger.info("offload.overlap_step auto: off (%s); the step runs after backward", reason)
        return False
    return True


def overlap_runs(wanted: bool, *, stage: int, grads_nvme: bool, daemon: bool) -> bool:
    """Whether the overlapped step ``overlap_wanted`` asked for runs: not at stage 3 with the accumulators on
    NVMe or a daemon's step record ([Note: early steps at stage 3]), where the log says it is off."""
    if not wanted or stage != 3 or not (grads_nvme or daemon):
        return wanted
    logger.warning("offload.overlap_step: off (stage 3 with %s); the step runs after backward",
                   "the gradient accumulators on NVMe" if grads_nvme else "a node daemon")
    return False


def copies_that_fit(sub_group_numels: list[int], *, available: int | None = None, local_ranks: int | None = None,
                    log: bool = True) -> int:
    """How many sub-groups' rollback copies (12 bytes per element) the host may hold: as many of the
    largest as fit in the share of the available memory the nvme window takes (``window_size``),
    at least MIN_COPIES. ``available``, ``local_ranks``, ``log``: as ``window_size`` takes them (the
    estimate asks about a machine's memory, once per row, quietly)."""
    return window_size([3 * F32 * n for n in sub_group_numels], floor=MIN_COPIES, fixed_bytes=0,
                       host_memory_bytes=None, what="offload.overlap_step rollback copies", log=log,
                       available=available, local_ranks=local_ranks)


class OverlappedStep:
    """Speculative early steps of complete sub-groups, validated at the step ([Note: overlapped step])."""

    def __init__(self, adam: PartitionedAdam, *, gradient_clipping: float, max_copies: int | None = None) -> None:
        """``max_copies``: with the state in host memory (cpu), at most this many sub-groups are stepped
        early per step, so the rollback copies hold at most that many state blocks; None: as many as fit
        in the nvme window's share of the memory available now (``copies_that_fit``)."""
        if not adam._on_host:
            raise ConfigError("offload.overlap_step needs the optimizer state offloaded "
                              "(zero_optimization.offload_optimizer.device cpu or nvme)")
        self.adam = adam
        self.clip = gradient_clipping
        self._held_params = adam._params_out is not None  # stage 3 ([Note: early steps at stage 3])
        if not self._held_params:
            adam.use_staging()
        layout = adam.layout
        self._sgs_of: dict[int, list[int]] = {}
        for sg in layout.sub_groups:
            for b in sorted({p.bucket for p in sg.pieces}):
                self._sgs_of.setdefault(b, []).append(sg.index)
        self._buckets_per_sg = [len({p.bucket for p in sg.pieces}) for sg in layout.sub_groups]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-overlap")
        """The one worker thread: early steps under backward, and a step's tail under forward."""
        self.max_copies = None if adam.storage.nvme else max_copies if max_copies is not None else \
            copies_that_fit([sg.numel for sg in layout.sub_groups])
        if self.max_copies is not None:
            held = sorted((sg.numel for sg in layout.sub_groups), reverse=True)[:self.max_copies]
            logger.info("offload.overlap_step: up to %d of %d sub-groups stepped under backward per step; their "
                        "rollback copies take up to %.2f GB of host memory (offload.overlap_step false: none)",
                        len(held), len(layout.sub_groups), 3 * F32 * sum(held) / 1e9)
        self._copies: list[torch.Tensor] = []  # rollback copies; the k-th early sub-group of a step uses the k-th
        self._params: list[torch.Tensor] = []  # stage 3: the k-th early sub-group's new params, until the verdict
        self.commit = None
        """The daemon's commit region (``offload.checkpoint.resume.CommitRegion``; the builder sets it): the rollback
        copies are then regions of its store, each recorded once whole ([Note: speculative step])."""
        fmt = adam.storage.format  # a block's elements: 3 x numel fp32, or its bytes (offload.state_dtype)
        self._block_numel = max(fmt.block_numel(sg) for sg in layout.sub_groups)
        self._block_dtype = fmt.block_dtype()
        self._left: list[int] = []
        self._armed = False
        self._hopeless = False
        self._mult = 0.0
        self._plan: StepPlan | None = None
        self._eager: list[int] = []  # sub-groups submitted this step, in order
        self._futures: list[concurrent.futures.Future] = []
        self._spans: list[tuple[float, float]] = []  # worker (start, end) per early sub-group
        self._backward_end = 0.0
        self.seconds_under_backward = 0.0
        """Early-step time that ran while backward still ran."""
        self.seconds_after_backward = 0.0
        """Early-step time that ran after backward, before ``engine.step()`` waited for it."""
        self.backup_seconds = 0.0
        """Worker time spent keeping copies of state blocks (cpu) under backward, within the two above."""
        self.ahead_seconds = 0.0
        """Worker time spent making copies ahead, after a step ([Note: copies ahead])."""
        self.copies_ahead_used = 0
        """Early sub-groups whose rollback copy had been made ahead (none made under backward)."""
        self._ahead: dict[int, int] = {}  # sub-group -> the rollback copy made ahead for it
        self._last_early = 0  # sub-groups the last step stepped under backward (kept or undone)
        self._ahead_future: concurrent.futures.Future | None = None
        self.rollback_seconds = 0.0
        """Time spent restoring early sub-groups (nvme: dropping them; the re-read is step time)."""
        self.early_sub_groups = 0
        """Sub-groups stepped early and kept."""
        self.last_early: list[int] = []
        """The last step's sub-groups stepped under backward and kept, in the order they were stepped."""
        self.rollbacks = 0
        """Steps whose early sub-groups were undone (clipping, overflow, a changed hyperparameter)."""
        self.tail = None
        """``offload.zero.step_tail.StepTail`` (``offload.step_under_forward``; the builder sets it): the sub-groups
        left after backward are stepped under the next forward."""
        adam.landed = self._landed

    @property
    def busy(self) -> bool:
        """Sub-groups were stepped early and not yet validated, or a step's tail runs (the worker may be on one)."""
        return bool(self._futures) or (self.tail is not None and self.tail.busy)

    def settle(self) -> None:
        """The last step's tail, if it runs under the forward, finished and published ([Note: the step under
        the next forward] in offload.zero.step_tail)."""
        if self.tail is not None:
            self.tail.finish()

    # -- backward ----------------------------------------------------------------------------

    def begin(self, loss_scale: float, world_size: int) -> None:
        """Before the boundary's backward: fix what a speculative step reads; arm the landing watch."""
        self.settle()
        self._drop_speculation()  # a speculation no step() validated (a boundary without engine.step())
        self._left = list(self._buckets_per_sg)
        self._mult = 1.0 / (loss_scale * world_size)
        self._plan = self.adam.prepare_step(count=False)
        self._hopeless = False
        self._backward_end = 0.0
        self._armed = True

    def backward_done(self) -> None:
        """Autograd has finished: buckets landed from now on are stepped with the rest."""
        self._armed = False
        self._backward_end = time.perf_counter()

    def _landed(self, bucket: Bucket) -> None:
        if not self._armed:
            return
        for sg in self._sgs_of.get(bucket.index, ()):
            self._left[sg] -= 1
            if self._left[sg] == 0:
                self._ready(sg)

    def _ready(self, sg: int) -> None:
        if sg in self.adam.storage.on_device:  # stepped on the device after backward ([Note: GPU-resident share])
            return
        if self._hopeless or not self._hopeful():
            self._hopeless = True
            return
        storage = self.adam.storage
        if storage.nvme and (len(self._eager) >= storage.window - 1 or not storage.prefetched(sg)):
            return
        if not storage.nvme and self.max_copies is not None and len(self._eager) >= self.max_copies:
            return
        if self.commit is not None and not storage.nvme and len(self._eager) >= MAX_EARLY:
            return  # the copies the step record can name
        if not storage.nvme and not self._have_copy(len(self._eager)):
            return
        if self._held_params:
            self._have_params(len(self._eager))
        self._futures.append(self.pool.submit(self._step_early, sg, len(self._eager)))
        self._eager.append(sg)

    def _hopeful(self) -> bool:
        """The sum of squares landed so far (a lower bound of the global one) is finite and unclipped."""
        partial = self.adam.sumsq
        if not math.isfinite(partial):
            return False
        return not (self.clip > 0 and clip_coefficient(math.sqrt(partial) * self._mult, self.clip) < 1.0)

    def _step_early(self, sg: int, k: int) -> None:  # on the worker thread
        t0 = time.perf_counter()
        storage = self.adam.storage
        state = storage.acquire(sg)
        if not storage.nvme and self._ahead.get(sg) == k:
            self.copies_ahead_used += 1
        elif not storage.nvme:
            self._copies[k][:state.numel()].copy_(state)
            if self.commit is not None:
                self.commit.early_copied(k, sg)  # whole: a restart may restore it from now on
            self.backup_seconds += time.perf_counter() - t0
        self.adam.step_sub_group(sg, state, self._mult, self._plan, out=self._params[k] if self._held_params else None)
        self._spans.append((t0, time.perf_counter()))

    # [Note: early steps at stage 3] Stage 3's step writes each piece's new params into its param shard, which
    # the units' gathers read. Stepped early, under backward, a sub-group's params go to a buffer of its own
    # instead (the k-th early sub-group's, its numel in the compute dtype) and into the shards on the caller's
    # thread once the verdict keeps them: the shards are never written from the worker (their store is not
    # shared between threads), and a speculation undone leaves them as they were. Gathered units are dropped
    # after the step as before (``after_step``). Not with the accumulators on NVMe (an early pass would need
    # one brought in on the worker) nor a daemon's step record: the builder leaves the overlap off then.
    def _have_params(self, k: int) -> None:
        while len(self._params) <= k:
            self._params.append(torch.empty(max(sg.numel for sg in self.adam.layout.sub_groups),
                                            dtype=self.adam.flat_params.dtype))

    def _have_copy(self, k: int) -> bool:
        """Rollback copy ``k`` exists (made now, on the calling thread, if not): plain host memory, or with
        the daemon a region of the session (kept from a previous process of it). False if the daemon has no
        room for it: no more sub-groups are stepped early then."""
        while len(self._copies) <= k:
            n = len(self._copies)
            if self.commit is None:
                self._copies.append(torch.empty(self._block_numel, dtype=self._block_dtype))
                continue
            store, name = self.commit.store, ROLLBACK_NAME.format(n)
            nbytes = self._block_numel * self._block_dtype.itemsize
            try:
                try:
                    held = store.info(name).nbytes
                except ConfigError:
                    held = None
                if held is not None and held < nbytes:
                    store.free(name)
                    held = None
                if held is None:
                    store.allocate(name, nbytes)
            except (TierFullError, QuotaExceededError) as exc:
                logger.warning("offload.overlap_step: no room in the daemon for rollback copy %d (%s): at most %d "
                               "sub-group(s) stepped under backward per step", n, exc, n)
                self.max_copies = n
                return False
            self._copies.append(torch.frombuffer(store.host_view(name), dtype=self._block_dtype,
                                                 count=self._block_numel))
        return True

    def _join(self) -> list[int]:
        """Wait for the worker; account its time; the sub-groups it stepped."""
        futures, self._futures = self._futures, []
        self._armed = False
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - raised below, after the rest finished
                error = error or exc
        end = self._backward_end or time.perf_counter()
        for t0, t1 in self._spans:
            under = max(0.0, min(t1, end) - t0)
            self.seconds_under_backward += under
            self.seconds_after_backward += (t1 - t0) - under
        self._spans = []
        eager, self._eager = self._eager, []
        if error is not None:
            raise error
        return eager

    # -- the verdict ---------------------------------------------------------------------------

    def step(self, grad_multiplier: float, *, record=None, progress=None) -> None:
        """The boundary's step (instead of ``PartitionedAdam.step``): keep the early sub-groups if the
        speculation holds, else undo them; step the rest; publish. ``record(plan, early)``: writes the
        step record once the early sub-groups are final, ``progress``: as ``PartitionedAdam.step_states``'s
        ([Note: speculative step] in offload.checkpoint.resume)."""
        self.settle()
        eager = self._join()
        self._last_early = len(eager)
        self._wait_ahead()  # (done already where sub-groups were stepped early: they queued after it)
        plan = self.adam.prepare_step()
        spec = self._plan
        if eager and (grad_multiplier != self._mult or plan.step_count != spec.step_count
                      or plan.hypers != spec.hypers):
            logger.debug("overlapped step %d: speculation did not hold (multiplier %r vs %r): %d sub-group(s) undone",
                         plan.step_count, grad_multiplier, self._mult, len(eager))
            self._undo(eager)
            eager = []
        if record is not None:
            record(plan, eager)
        if self.adam.storage.nvme:
            for sg in eager:
                self.adam.storage.release(sg, dirty=True)
        self.early_sub_groups += len(eager)
        self.last_early = list(eager)
        self.adam.reset_publishing()
        self.adam.publish_sub_groups(eager)  # final now ([Note: publish as stepped] in offload.zero.optimizer)
        for k, sg in enumerate(eager if self._held_params else ()):  # into their shards now
            self.adam.write_params(sg, self._params[k])
        self._ahead = {}
        if self.tail is not None and record is None and progress is None:
            self._step_under_forward(grad_multiplier, plan, eager)
        else:
            self.adam.step_states(grad_multiplier, plan, skip=frozenset(eager), progress=progress, publish_early=True)
            self.adam.publish()
        self._copy_ahead()

    # [Note: copies ahead] A rollback copy is of the state before the step, which is final as soon as the last
    # step is: the copies for the next step's early sub-groups (the first ones that are not on the device: they
    # complete first, [Note: overlapped step]; as many as the last step stepped early and one more, so that host
    # memory holds the copies a backward uses, not all it may) are made right after a step, on the worker, queued after that
    # step's own work (its tail under the next forward), so that they run while the next forward and backward
    # (with accumulation, several of them) leave the CPU idle, not under the boundary's backward, where each one
    # took 1.1-1.7x the Adam pass it guards. An early sub-group whose copy was made ahead is stepped at once; any
    # other is copied first, as before. The copies are dropped when the state may change behind the overlap's
    # back (``cancel``: a checkpoint loaded, an overflow); the undo of a speculation leaves them true. Not with
    # nvme (nothing to copy) nor a daemon's step record (its copies are recorded as the speculative step begins).
    def _copy_ahead(self) -> None:
        if self.adam.storage.nvme or self.commit is not None or not self.max_copies:
            return
        on_device = self.adam.storage.on_device
        count = min(self.max_copies, self._last_early + 1)  # what the last backward held, and one more
        sgs = [i for i in range(len(self.adam.layout.sub_groups)) if i not in on_device][:count]
        if sgs and all(self._have_copy(k) for k in range(len(sgs))):
            self._ahead_future = self.pool.submit(self._make_copies, sgs)

    def _make_copies(self, sgs: list[int]) -> None:  # on the worker thread
        t0 = time.perf_counter()
        for k, sg in enumerate(sgs):
            state = self.adam.storage.state(sg)
            self._copies[k][:state.numel()].copy_(state)
            self._ahead[sg] = k
        self.ahead_seconds += time.perf_counter() - t0

    def _wait_ahead(self) -> None:
        future, self._ahead_future = self._ahead_future, None
        if future is not None:
            future.result()

    def _step_under_forward(self, mult: float, plan: StepPlan, eager: list[int]) -> None:
        """The device's share enqueued now; the rest on the worker, in the order the next forward needs them, under
        it ([Note: the step under the next forward] in offload.zero.step_tail)."""
        on_device = self.adam.storage.on_device
        n = len(self.adam.layout.sub_groups)
        if on_device:
            self.adam.step_states(mult, plan, order=sorted(on_device), publish_early=True)
        self.tail.start({i for i in range(n) if i not in on_device and i not in eager}, mult, plan)

    def cancel(self) -> None:
        """The step will not run (an overflow, a checkpoint loaded): undo what was stepped early (a last step's
        tail is finished first); the copies made ahead are dropped ([Note: copies ahead])."""
        self.settle()
        self._drop_speculation()
        self._wait_ahead()
        self._ahead = {}

    def _drop_speculation(self) -> None:
        eager = self._join()
        if eager:
            self._undo(eager)

    def _undo(self, eager: list[int]) -> None:
        t0 = time.perf_counter()
        storage = self.adam.storage
        for k, sg in enumerate(eager):
            if storage.nvme:
                storage.release(sg, dirty=False)  # NVMe holds the state from before the step
            else:
                state = storage.state(sg)
                state.copy_(self._copies[k][:state.numel()])
        self.rollbacks += 1
        self.rollback_seconds += time.perf_counter() - t0

    def close(self) -> BaseException | None:
        """Undo what was stepped early, finish a step's tail, stop the worker. Returns what failed on the worker
        (the engine raises it once its tiers are closed), None when nothing did."""
        failure = None
        try:
            self.cancel()
        except BaseException as exc:  # noqa: BLE001 - returned, not lost
            failure = exc
        if self.tail is not None:
            self.tail.remove_hooks()
        self.pool.shutdown(wait=True)
        return failure
