"""The GPU side of offload: host memory registered with CUDA, copy streams, the batched
small-tensor gather, the size threshold that picks between them.

Everything here imports and runs without a GPU (torch's CPU build): registration is a
no-op, the streams are plain synchronous copies, and the Triton kernel is only launched
on CUDA tensors (or under ``TRITON_INTERPRET=1`` in the tests).
"""
from offload.gpu.registration import HostRegistration, cuda_host_api, tier_host_ranges

__all__ = ["HostRegistration", "cuda_host_api", "tier_host_ranges"]
