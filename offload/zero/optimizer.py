"""Adam over this rank's partition, sub-group by sub-group, wherever the state lives.

``PartitionedAdam`` lands reduced gradients in the fp32 accumulators (taking the sum of
squares as they land), steps every sub-group with one fused pass (the gradient
multiplier and the low-precision param copy folded in), pipelines NVMe I/O (prefetch
i+1 while stepping i while evicting i-1, see [Note: state window] in
``offload.zero.states``), and all-gathers the updated parameters back into the flat
buffer. ``OffloadOptimizer`` is what ``initialize`` returns as the optimizer: a
``torch.optim.Optimizer`` whose param groups hold the hyperparameters, so torch's LR
schedulers drive it; stepping goes through the engine.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

from cpu_adam import AdamConfig, adam_step, grad_land, grad_sumsq
from csrc import ConfigError
from offload.zero.collectives import all_gather_single
from offload.zero.device_adam import device_sumsq, torch_adam
from offload.zero.grads import Source, shard_source
from offload.zero.layout import Bucket, FlatLayout, Piece, SubGroup
from offload.zero.states import StateStorage

logger = logging.getLogger(__name__)

__all__ = ["OffloadOptimizer", "PartitionedAdam", "StepPlan"]


class StepPlan(NamedTuple):
    """What one optimizer step reads besides the states (``PartitionedAdam.prepare_step``)."""

    step_count: int
    hypers: dict[int, AdamConfig]
    grads: list[torch.Tensor]


class OffloadOptimizer(torch.optim.Optimizer):
    """The optimizer ``initialize`` returns: hyperparameters per param group, read at every step.

    ``engine.step()`` computes the gradient multiplier and calls ``step()`` here, which applies
    the update through the engine (so torch's LR schedulers see a real optimizer step). Called
    any other way, ``step()`` is an error that says to use the engine."""

    def __init__(self, param_groups: list[dict[str, Any]], defaults: dict[str, Any], apply, zero_grad) -> None:
        super().__init__(param_groups, defaults)
        self._apply = apply
        self._zero_grad = zero_grad

    def step(self, closure=None):  # noqa: D102 - torch's signature
        if closure is not None:
            raise ConfigError("the offload optimizer takes no closure: call engine.backward(loss) then engine.step()")
        self._apply()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self._zero_grad()


# [Note: landing]
# Gradients reach the fp32 accumulators in one pass per bucket (cpu_adam.grad_land): copy at a
# cycle's first micro-step, add at later ones, the sum of squares for the clip norm taken from
# the landed values in the same pass, and, where the shard is the flat gradient buffer itself
# (stage 0's all-reduce in place, or one rank accumulating), the buffer zeroed as it is read so
# that the next backward accumulates into zeros without a separate zeroing pass. Three passes
# over the gradient (copy, sum of squares, zero) become one; on one rank the source is usually
# autograd's own gradients ([Note: gradients straight from autograd] in offload.zero.grads).


class PartitionedAdam:
    """Sub-grouped Adam of one rank's partition (see the module docstring)."""

    def __init__(self, layout: FlatLayout, storage: StateStorage, flat_params: torch.Tensor, *,
                 optimizer: OffloadOptimizer, adamw_mode: bool, bias_correction: bool,
                 group: dist.ProcessGroup | None, comm_world: int, gather: bool, num_threads: int | None = None,
                 params_out: Callable[[Piece], torch.Tensor] | None = None,
                 after_step: Callable[[], None] | None = None, fetcher: Any = None, node: Any = None) -> None:
        """``params_out`` (stage 3): where a piece's updated low-precision params go instead of the
        flat buffer (this rank's shard; nothing is gathered after the step); ``after_step`` runs then.
        ``fetcher`` (``offload.gpu.Fetcher``, a GPU model): copies the staged params to the device.
        ``node`` (``offload.zero.node_buffers.NodeBuffers``): ``flat_params`` is the ranks' shared param
        buffer, so the all-gather after a step is a barrier ([Note: node-shared buffers])."""
        self.layout = layout
        self.storage = storage
        self.flat_params = flat_params
        self.optimizer = optimizer
        self.adamw_mode = adamw_mode
        self.bias_correction = bias_correction
        self.group = group
        self.comm_world = comm_world
        self.gather = gather  # stages 1-2 over several ranks: all-gather the shards after the step
        self.num_threads = num_threads
        self._params_out = params_out
        self._after_step = after_step
        self.step_count = 0
        self.sumsq = 0.0
        self._sumsq_device: torch.Tensor | None = None  # the device-resident accumulators' share, read at the step
        self.undo: Any = None
        """``cpu_adam.undo.UndoLog`` (with the daemon; ``offload.zero.block_undo.BlockUndo`` for compressed
        states): recorded steps log their passes in it."""
        self.landed: Callable[[Bucket], None] | None = None
        """Told of each bucket landed at a cycle's last micro-step (``offload.zero.overlap``)."""
        self._on_host = storage.tier is not None or storage.device.type == "cpu"
        """Some of the state is stepped by cpu_adam (all but ``storage.on_device``'s sub-groups, with a tier)."""
        self._on_device = storage.on_device if storage.tier is not None else frozenset()
        """Sub-groups of an offloaded optimizer kept on the device ([Note: GPU-resident share] in
        offload.zero.device_share): stepped by torch's fused AdamW, their params written in place."""
        if (not self._on_host or self._on_device) and not bias_correction:
            raise ConfigError("optimizer.params.bias_correction false is not supported with the optimizer "
                              "state on a GPU (torch's Adam always corrects): offload it to cpu or nvme")
        self._fetcher = fetcher
        self._node = node
        self._fetch_pending: list = []  # the last publish's staging -> device copies, until their sources may be rewritten
        self._publishing: list = []  # this step's copies started as sub-groups were stepped ([Note: publish as stepped])
        self._fetched: set[int] = set()  # their sub-groups
        self._staging = None
        if self._on_host and flat_params.device.type != "cpu" and params_out is None:
            self._staging = torch.empty(layout.partition_numel, dtype=flat_params.dtype,
                                        pin_memory=torch.cuda.is_available())
        self._by_bucket: dict[int, list[tuple[int, Piece]]] = {}
        for sg in layout.sub_groups:
            for piece in sg.pieces:
                self._by_bucket.setdefault(piece.bucket, []).append((sg.index, piece))
        # whether a bucket's pieces cover its whole shard (then zeroing them zeroes the shard)
        self._covers = [sum(p.numel for _, p in self._by_bucket.get(b.index, ())) == b.shard_numel
                        for b in layout.buckets]

    # -- gradients ---------------------------------------------------------------------------

    def land(self, bucket: Bucket, source: Source | torch.Tensor, first: bool, final: bool,
             zero_source: bool = False) -> bool:
        """Copy (first micro-step) or add a bucket's reduced gradient, read through ``source`` (or this
        rank's shard of it as one tensor), into the accumulators, taking the sum of squares in the same
        pass at the cycle's last micro-step. With ``zero_source`` the source (the bucket's shard) may be
        zeroed as it is read; returns True if it was (every element of the shard is zero now)."""
        if isinstance(source, torch.Tensor):
            source = shard_source(source, bucket.shard_start(self.layout.rank))
        dsts, srcs = [], []
        pieces = self._by_bucket.get(bucket.index, ())
        for sg, p in pieces:
            acc = self.storage.grad_for_landing(sg, first)
            for off, src in source(p.flat_start, p.numel):
                dsts.append(acc[p.sub_start + off:p.sub_start + off + src.numel()])
                srcs.append(src)
        zero = False
        if all(t.is_cpu for t in srcs) and all(d.is_cpu for d in dsts):  # one fused C pass ([Note: landing])
            zero = zero_source and self._covers[bucket.index]
            total = grad_land(dsts, srcs, accumulate=not first, zero_sources=zero, num_threads=self.num_threads)
            if final:
                self.sumsq += total
        else:
            for src, dst in zip(srcs, dsts):
                if first:
                    dst.copy_(src)
                else:
                    dst.add_(src)
                if not final:
                    continue
                if dst.is_cpu:
                    self.sumsq += grad_sumsq([dst], num_threads=self.num_threads)
                else:  # kept on the device, read once at the step (no wait a bucket)
                    part = device_sumsq(dst)
                    self._sumsq_device = part if self._sumsq_device is None else self._sumsq_device.add_(part)
        for sg, _ in pieces:  # (with the gradient tier on NVMe, a sub-group's last piece sends it back)
            self.storage.grad_landed(sg)
        if final and self.landed is not None:
            self.landed(bucket)
        return zero

    def global_sumsq(self) -> float:
        """The sum of squares of the whole (summed, scaled) gradient, over all ranks; resets the tally."""
        total, self.sumsq = self.sumsq, 0.0
        if self._sumsq_device is not None:
            total += float(self._sumsq_device.item())
            self._sumsq_device = None
        if self.gather and self.comm_world > 1:
            t = torch.tensor([total], dtype=torch.float64)
            if self.flat_params.device.type == "cuda":
                t = t.cuda()
            dist.all_reduce(t, group=self.group)
            total = float(t.item())
        return total

    # -- the step ----------------------------------------------------------------------------

    def prefetch_states(self) -> None:
        """Start bringing the first sub-groups' states in (called as backward begins)."""
        self.storage.prefetch(range(len(self.layout.sub_groups)))

    def step(self, grad_multiplier: float) -> None:
        """One Adam step of every sub-group, then the updated params back into the flat buffer."""
        self.step_states(grad_multiplier, self.prepare_step(), publish_early=True)
        self.publish()

    def prepare_step(self, grads: list[torch.Tensor] | None = None, *, count: bool = True) -> StepPlan:
        """What one step reads besides the states, fixed now (the step may run on another thread
        while the LR scheduler moves on): the step number, each group's hyperparameters, the
        gradient accumulators (``grads``, default the storage's). Counts the step unless ``count``
        is False (the plan of a step that may not happen: ``offload.zero.overlap``)."""
        plan = StepPlan(self.step_count, {g: self._hyper(g) for g in range(len(self.optimizer.param_groups))},
                        grads if grads is not None else self.storage.step_grads())
        if count:
            self.step_count += 1
        return plan

    def step_states(self, grad_multiplier: float, plan: StepPlan, skip: frozenset[int] = frozenset(),
                    progress: Any = None, resume: bool = False, publish_early: bool = False,
                    order: Sequence[int] | None = None, stepped: Callable[[int, Any], None] | None = None) -> None:
        """Adam over every sub-group's state but ``skip``'s (NVMe I/O pipelined); the new low-precision
        params go to ``_out`` (the staging buffer when there is one: ``publish`` brings them to the model).
        ``progress`` (``offload.checkpoint.resume.CommitRegion``, with ``skip`` stepped already): told as each Adam pass
        starts and as each sub-group is stepped and marked dirty, each pass logged in ``undo``; with
        ``resume`` the first pass is one a killed process started ([Note: restartable step]). ``publish_early``:
        ``publish`` follows at once (nothing reads the params meanwhile), so each sub-group's params start for
        the device as soon as it is stepped ([Note: publish as stepped]). ``order``: these sub-groups, in this
        order, instead of all but ``skip``'s (the caller published the others: ``offload.zero.step_tail``);
        ``stepped(i, pending)``: told as each is stepped and published (``pending``: its copies, or None)."""
        fresh = order is None and not skip  # (else the caller published what it stepped before: ``reset_publishing``)
        if order is None:
            order = [i for i in range(len(self.layout.sub_groups)) if i not in skip]
            if self._on_device:  # enqueued on the device first, so that its Adam runs under the host's
                order = [i for i in order if i in self._on_device] + [i for i in order if i not in self._on_device]
        order = list(order)
        self.storage.prefetch(order)
        self._staging_free()
        if fresh:
            self.reset_publishing()
        logged = progress is not None and self.undo is not None and self._on_host
        self.storage.prefetch_grads(order)
        for k, i in enumerate(order):
            state = self.storage.acquire(i)
            self.storage.prefetch(order[k + 1:])
            grad = plan.grads[i]
            if grad is None:  # on NVMe ([Note: gradient tier] in offload.zero.grad_tier)
                grad = self.storage.acquire_grad(i)
                self.storage.prefetch_grads(order[k + 1:])
            if progress is not None:
                self.storage.will_write(i)  # before the pass: the daemon keeps what it writes
                if logged and not (resume and k == 0):
                    self.undo.begin()
                progress.sub_group_started(i)
            self._step_sub_group(self.layout.sub_groups[i], state, grad_multiplier, plan,
                                 logged=(resume and k == 0) if logged and i not in self._on_device else None, grad=grad)
            pending = self.publish_sub_groups([i]) if publish_early else None
            self.storage.release(i, dirty=True)
            if plan.grads[i] is None:
                self.storage.release_grad(i)
            if progress is not None:
                progress.sub_group_done(i + 1)
            if stepped is not None:
                stepped(i, pending)

    def step_sub_group(self, i: int, state: torch.Tensor, grad_multiplier: float, plan: StepPlan,
                       out: torch.Tensor | None = None) -> None:
        """Adam over one sub-group's resident ``state`` (``offload.zero.overlap`` steps them one by one); ``out``:
        the sub-group's new params go there (its numel, in its order), not to the params (``write_params``)."""
        self._staging_free()
        self._step_sub_group(self.layout.sub_groups[i], state, grad_multiplier, plan, out=out)

    def write_params(self, i: int, values: torch.Tensor) -> None:
        """Sub-group ``i``'s params from ``values`` (what ``step_sub_group(out=values)`` wrote)."""
        for p in self.layout.sub_groups[i].pieces:
            self._out(p).copy_(values[p.sub_start:p.sub_start + p.numel])

    # [Note: publish as stepped] With the params on a GPU and the state on the host, the updated params of a
    # step reach the model through the staging buffer, a host -> device copy on the fetcher's stream. Made
    # once for the whole partition after the last sub-group's Adam pass, it was the step's tail (2 GB at
    # 1B in bf16: ~36 ms at 55 GB/s, against a CPU Adam of ~190 ms). Where nothing reads the params until
    # ``publish`` (the ordinary step, the recorded one, the overlapped step once its verdict is known; not
    # the delayed update, whose step runs beside forward), each sub-group's copy starts as soon as its pass
    # has written it, under the next sub-group's pass, and ``publish`` makes the compute stream wait for them
    # all: the same bytes into the same places, the copies no longer after the step but under it. Not with
    # stage 3 (its shards are written in place) nor node-shared buffers (the ranks' barrier comes first).
    def reset_publishing(self) -> None:
        """A new step's publishing begins: copies a step cut short (an exception) started are waited for and
        forgotten, so every sub-group goes over again."""
        pending, self._publishing, self._fetched = self._publishing, [], set()
        for p in pending:
            self._fetcher.wait_sources(p)

    def publish_sub_groups(self, sgs: Iterable[int]) -> Any:
        """Start the staged params of ``sgs``, stepped and final, for the device now, on the fetcher's H2D stream,
        where ``publish`` then only waits for them ([Note: publish as stepped]); returns those copies (None: none
        started). Staged on the CPU (no fetcher) they are copied at once. Without staging, or with stage 3 or
        node-shared buffers, nothing: ``publish`` copies everything."""
        if self._staging is None or self._params_out is not None or self._node is not None:
            return None
        sgs = [i for i in sgs if i not in self._fetched and i not in self._on_device]
        if not sgs:
            return None
        self._fetched.update(sgs)
        if self._fetcher is None:
            for dst, src in self._staged_pairs(sgs):
                dst.copy_(src)
            return None
        pending = self._fetcher.start_fetch(self._staged_pairs(sgs))
        self._publishing.append(pending)
        return pending

    def publish(self) -> None:
        """The updated params into the model: staging to the flat buffer, shards all-gathered."""
        if self._staging is not None:
            if self._node is not None:  # no rank reads the shared params while the staged shards go in
                self._node.barrier()
            self._copy_staging_to_device()
        if self.gather and self._params_out is None:
            self._all_gather()
        if self._after_step is not None:
            self._after_step()

    def use_staging(self) -> None:
        """Write updated params to a staging buffer even on the CPU (a step running beside forward
        must not write the params forward reads: ``offload.zero.delayed``)."""
        if self._params_out is not None:
            raise ConfigError("a staged parameter update is not supported with stage 3 (offload_param) yet")
        if self._staging is None:
            self._staging = torch.empty(self.layout.partition_numel, dtype=self.flat_params.dtype,
                                        pin_memory=torch.cuda.is_available())
            for sg in self.layout.sub_groups:
                for p in sg.pieces:
                    self._staging[p.part_start:p.part_start + p.numel].copy_(
                        self.flat_params[p.flat_start:p.flat_start + p.numel])

    def write_params_from_master(self) -> None:
        """The params from the fp32 masters (after a resume, when only the tier kept the state)."""
        order = range(len(self.layout.sub_groups))
        self._staging_free()
        self.reset_publishing()
        for i in order:
            state = self.storage.acquire(i)
            self.storage.prefetch(order[i + 1:])
            sg = self.layout.sub_groups[i]
            master = self.storage.format.master(sg, state)
            for p in sg.pieces:
                self._out(p, staged=i not in self._on_device).copy_(master[p.sub_start:p.sub_start + p.numel])
            self.storage.release(i, dirty=False)
        self.storage.drain()
        if self._staging is not None:
            self._copy_staging_to_device()
        if self.gather:
            self._all_gather()

    def _hyper(self, group: int) -> AdamConfig:
        g = self.optimizer.param_groups[group]
        beta1, beta2 = g["betas"]
        return AdamConfig(lr=float(g["lr"]), beta1=beta1, beta2=beta2, eps=g["eps"], weight_decay=g["weight_decay"],
                          adamw_mode=self.adamw_mode, bias_correction=self.bias_correction,
                          num_threads=self.num_threads)

    def _out(self, piece: Piece, staged: bool = True) -> torch.Tensor:
        """Where a piece's new params go. ``staged`` False: never the staging buffer (a device-resident piece,
        stepped in place after backward, before anything reads its params again)."""
        if self._params_out is not None:
            return self._params_out(piece)
        if staged and self._staging is not None:  # a GPU model: the copy lands on the host, then goes over at once
            return self._staging[piece.part_start:piece.part_start + piece.numel]
        return self.flat_params[piece.flat_start:piece.flat_start + piece.numel]

    def _step_sub_group(self, sg: SubGroup, state: torch.Tensor, mult: float, plan: StepPlan,
                        logged: bool | None = None, grad: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> None:
        """``out``: as ``step_sub_group``'s. ``logged``: None, or the pass goes through the undo log, resuming a cut one if True (compressed
        states: through the undo copy of the block, [Note: block undo] in offload.zero.block_undo).
        ``grad``: the sub-group's accumulator, where the plan's is None (brought in by the caller)."""
        grad = plan.grads[sg.index] if grad is None else grad
        if not self.storage.format.fp32:
            if logged and self.undo.restore(sg.index, state):
                logger.warning("rank %d: sub-group %d's state block, which a killed Adam pass left half written, "
                               "restored from its undo copy", self.layout.rank, sg.index)
            elif logged is not None:
                self.undo.save(sg.index, state)
            self._step_compressed(sg, state, grad, mult, plan, out)
            return
        n = sg.numel
        master, exp_avg, exp_avg_sq = state[:n], state[n:2 * n], state[2 * n:]
        call = 0
        for group in sorted({p.group for p in sg.pieces}):
            in_group = [p for p in sg.pieces if p.group == group]
            # stage 3: a piece's output is a param shard that ``params_out`` may give back (and evict) when
            # a later one is asked for, so each piece is stepped before the next is asked for
            for pieces in ([p] for p in in_group) if self._params_out is not None else [in_group]:
                self._step_pieces(pieces, master, grad, exp_avg, exp_avg_sq, plan.hypers[group], mult,
                                  plan.step_count, None if logged is None else (call, logged),
                                  host=self._on_host and sg.index not in self._on_device, out=out)
                call += 1

    def _step_pieces(self, pieces: list[Piece], master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, hyper: AdamConfig, mult: float, step_count: int,
                     logged: tuple[int, bool] | None = None, host: bool = True, out: torch.Tensor | None = None) -> None:
        """``host``: cpu_adam steps the pieces, else torch's fused Adam (their state is on the device)."""
        cut = [(p.sub_start, p.sub_start + p.numel) for p in pieces]
        masters = [master[a:b] for a, b in cut]
        grads = [grad[a:b] for a, b in cut]
        ms = [exp_avg[a:b] for a, b in cut]
        vs = [exp_avg_sq[a:b] for a, b in cut]
        outs = [self._out(p, staged=host) if out is None else out[p.sub_start:p.sub_start + p.numel] for p in pieces]
        if logged is not None:  # (call, resume): [Note: restartable step] in offload.checkpoint.resume
            steps = [torch.full((1,), float(step_count)) for _ in pieces]
            restored = self.undo.step(masters, grads, ms, vs, steps, config=hyper, grad_scale=mult, params_out=outs,
                                      call=logged[0], resume=logged[1])
            if restored:
                logger.warning("rank %d: %d piece(s) a killed Adam pass left half written restored from the undo log",
                               self.layout.rank, restored)
        elif host:
            steps = [torch.full((1,), float(step_count)) for _ in pieces]
            adam_step(masters, grads, ms, vs, steps, config=hyper, grad_scale=mult, params_out=outs)
        else:
            torch_adam(masters, grads, ms, vs, outs, hyper, mult, step_count)

    def _step_compressed(self, sg: SubGroup, state: torch.Tensor, grad: torch.Tensor, mult: float,
                         plan: StepPlan, out: torch.Tensor | None = None) -> None:
        """``_step_sub_group`` over bf16 / int8 moments (``offload.zero.state_format``): one call per
        param group, or per piece with stage 3, as the fp32 path."""
        fmt = self.storage.format
        for group in sorted({p.group for p in sg.pieces}):
            in_group = [p for p in sg.pieces if p.group == group]
            for pieces in ([p] for p in in_group) if self._params_out is not None else [in_group]:
                views = [fmt.piece(sg, state, p) for p in pieces]
                grads = [grad[p.sub_start:p.sub_start + p.numel] for p in pieces]
                outs = [self._out(p) if out is None else out[p.sub_start:p.sub_start + p.numel] for p in pieces]
                steps = [torch.full((1,), float(plan.step_count)) for _ in pieces]
                q8 = views[0].exp_avg_scale is not None
                # a bf16 master's rounding is keyed by where its elements are in the model ([Note: a bf16 master])
                seeds = [p.flat_start for p in pieces] if fmt.master_dtype is torch.bfloat16 else None
                adam_step([v.master for v in views], grads, [v.exp_avg for v in views], [v.exp_avg_sq for v in views],
                          steps, config=plan.hypers[group], grad_scale=mult, params_out=outs,
                          exp_avg_scales=[v.exp_avg_scale for v in views] if q8 else None,
                          exp_avg_sq_scales=[v.exp_avg_sq_scale for v in views] if q8 else None, master_seeds=seeds)

    def _staged_pairs(self, sgs: Iterable[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.flat_params[p.flat_start:p.flat_start + p.numel], self._staging[p.part_start:p.part_start + p.numel])
                for i in sgs for p in self.layout.sub_groups[i].pieces]

    def _copy_staging_to_device(self) -> None:
        rest = [i for i in range(len(self.layout.sub_groups)) if i not in self._fetched and i not in self._on_device]
        self._fetched = set()
        if self._fetcher is None:
            for dst, src in self._staged_pairs(rest):
                dst.copy_(src, non_blocking=True)
            return
        # H2D on the fetcher's stream; the compute stream (the next forward) waits for it, the host does not
        if rest:
            self._publishing.append(self._fetcher.start_fetch(self._staged_pairs(rest)))
        for pending in self._publishing:
            self._fetcher.wait_fetch(pending)
        self._fetch_pending, self._publishing = self._fetch_pending + self._publishing, []

    def _staging_free(self) -> None:
        """Before the staging buffer is written again: the last publish's copies out of it have read it (this
        step's, started as its sub-groups were stepped, read what is final: [Note: publish as stepped])."""
        pending, self._fetch_pending = self._fetch_pending, []
        for p in pending:
            self._fetcher.wait_sources(p)

    def _all_gather(self) -> None:
        if self._node is not None:  # every rank wrote its shard into the one shared buffer
            self._node.barrier()
            return
        works = []
        for b in self.layout.buckets:
            full = self.flat_params[b.start:b.start + b.numel]
            mine = full[self.layout.rank * b.shard_numel:(self.layout.rank + 1) * b.shard_numel]
            works.append(all_gather_single(full, mine.clone(), group=self.group, async_op=True))
        for w in works:
            w.wait()

    # -- state access (checkpoints) ------------------------------------------------------------

    def iter_states(self, *, write: bool = False) -> Iterator[tuple[SubGroup, torch.Tensor]]:
        """Each sub-group's state block in turn, resident only while the caller holds it."""
        order = range(len(self.layout.sub_groups))
        for i in order:
            state = self.storage.acquire(i)
            self.storage.prefetch(order[i + 1:i + 2])
            try:
                yield self.layout.sub_groups[i], state
            finally:
                self.storage.release(i, dirty=write)
        self.storage.drain()
