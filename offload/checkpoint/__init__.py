"""Checkpoints and the state that outlives a trainer: save, load and consolidate, their tags, the
daemon's per-step commit and resume.

- ``dcp``: checkpoints through ``torch.distributed.checkpoint``: save, load onto any world size;
- ``weights``: a checkpoint back into plain weights (consolidate): a state dict, or safetensors;
- ``tags``: the ``latest`` pointer, retention, a failed save's leftovers;
- ``resume``: the per-step commit in the daemon's memory, and resume from it after a crash;
- ``rng``: the random number generators' states, as both save and restore them.

The names of ``dcp`` and ``weights`` load on first use (``offload.checkpoint.save_checkpoint``), so that
importing ``resume`` or ``tags`` does not import ``torch.distributed.checkpoint``.
"""
__all__ = ["checkpoint_path", "checkpoint_step", "consolidate", "consolidate_safetensors", "load_checkpoint",
           "resolve_path", "save_checkpoint"]

_WEIGHTS = ("consolidate", "consolidate_safetensors")


def __getattr__(name: str):
    if name in _WEIGHTS:
        from offload.checkpoint import weights

        return getattr(weights, name)
    if name in __all__:
        from offload.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'offload.checkpoint' has no attribute {name!r}")
