"""[Note: copies ahead] in offload.zero.overlap: the rollback copies of the next step's early sub-groups are made
right after a step, on the worker, so that under backward the early sub-groups are only stepped. Oracle: the
serial step (``overlap_step`` false), bit for bit, through rollbacks (clipping, overflows) and through a
checkpoint loaded between two steps (the copies made ahead of it are of a state that is gone)."""
from __future__ import annotations

import pytest
import torch

from offload.builder import initialize
from tests.offload.harness import engine_config, loss_fn, make_batches, param_groups, run_engine, twin_models
from tests.offload.test_overlap import _poison_first_layer

BATCH = 8
CLIP_GAS2 = 5.0  # some steps of this model clip at gas 2, some do not (tests/offload/test_overlap.py)


@pytest.fixture(autouse=True)
def window_at_buffer_count(monkeypatch):
    monkeypatch.setattr("offload.plan.budget.available_bytes", lambda: None)


def _config(overlap: bool, *, gas: int = 1, clip: float = 0.0):
    return engine_config(stage=2, device="cpu", batch_size=BATCH, gas=gas, gradient_clipping=clip,
                         offload={"overlap_step": overlap})


def test_early_sub_groups_use_the_copies_made_ahead_and_roll_back_exactly():
    runs = {}
    for overlap in (True, False):
        model, _ = twin_models()
        seen = {}
        runs[overlap] = run_engine(model, _config(overlap, gas=2, clip=CLIP_GAS2), make_batches(16, 2 * BATCH), gas=2,
                                   on_step=lambda engine, step: seen.update(overlap=engine.overlap)) + (seen,)
    (losses, params, seen), (serial_losses, serial_params, _) = runs[True], runs[False]
    assert losses == serial_losses
    for name in params:
        assert torch.equal(params[name], serial_params[name]), name
    overlap = seen["overlap"]
    assert overlap.rollbacks > 0 and overlap.early_sub_groups > 0  # kept ones and undone ones, from the same copies
    assert overlap.copies_ahead_used > overlap.early_sub_groups // 2 and overlap.ahead_seconds > 0


def test_a_checkpoint_loaded_drops_the_copies_made_ahead(tmp_path):
    """Steps 0-2, save, steps 3-5, load (the state of step 2), then an overflow after early steps: the undo must
    restore the loaded state, not the copies made after step 5."""
    batches = make_batches(9, BATCH)
    out = {}
    for overlap in (True, False):
        model, _ = twin_models()
        _poison_first_layer({6})(model)  # the 7th backward: after the load
        engine, _, _, _ = initialize(model=model, config=_config(overlap), model_parameters=param_groups(model))
        try:
            for i, (x, y) in enumerate(batches):
                engine.backward(loss_fn(engine(x), y))
                engine.step()
                if i == 2:
                    engine.save_checkpoint(str(tmp_path / f"ckpt-{overlap}"), tag="t")
                if i == 5:
                    engine.load_checkpoint(str(tmp_path / f"ckpt-{overlap}"), tag="t")
            engine.settle()
            out[overlap] = ({n: p.detach().clone() for n, p in model.named_parameters()}, engine.skipped_steps,
                            engine.overlap)
        finally:
            engine.close()
    (params, skipped, overlap), (serial_params, serial_skipped, _) = out[True], out[False]
    assert skipped == serial_skipped == 1 and overlap.rollbacks == 1 and overlap.copies_ahead_used > 0
    for name in params:
        assert torch.equal(params[name], serial_params[name]), name
