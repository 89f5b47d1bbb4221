"""``offload.step_under_forward`` with the model on a GPU ([Note: the step under the next forward] in
offload.zero.step_tail): the sub-groups left after backward go back on the H2D stream from the worker thread, and
each module's forward makes the compute stream wait for its own; against the serial step bit for bit, with half
of the state on the GPU too. The worker is slowed (a sleep per pass on its thread), so that a module that did not
wait would read the last step's params. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.offload.harness import engine_config, make_batches, run_engine, twin_models

pytestmark = pytest.mark.cuda

STEPS = 12
BATCH = 8


def _run(tmp_path, *, tail: bool, device: str, ratio: float | None):
    model, _ = twin_models()
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(STEPS, BATCH)]
    config = engine_config(stage=1, device=device, nvme_path=tmp_path, batch_size=BATCH,
                           offload={"overlap_step": tail, "step_under_forward": tail})
    config["zero_optimization"]["sub_group_size"] = 300
    if ratio is not None:
        config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    seen = {}
    losses, params = run_engine(model, config, batches, on_step=lambda e, i: seen.update(stats=e.offload_stats()))
    return losses, params, seen["stats"]


@pytest.mark.parametrize("device,ratio", [("cpu", None), ("nvme", None), ("cpu", 0.5)])
def test_the_step_under_the_forward_on_the_gpu_is_the_serial_step(few_early, slow_worker, tmp_path, device, ratio):
    losses, params, stats = _run(tmp_path, tail=True, device=device, ratio=ratio)
    serial_losses, serial_params, _ = _run(tmp_path, tail=False, device=device, ratio=ratio)
    assert stats.sub_groups_stepped_under_forward_total > 0
    assert losses == serial_losses
    for name in params:
        assert torch.equal(params[name], serial_params[name]), name
