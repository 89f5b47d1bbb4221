"""The two collectives ZeRO's gradients and params go through, by torch's current names.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single``
/ ``reduce_scatter_single`` (same arguments) and the old names raise a FutureWarning on every
call; older torch has only the old names."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
