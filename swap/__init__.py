"""Swap: async direct NVMe I/O engines, aligned shared-memory host buffers, swap space, TierStore.

Not built yet (issue: "Swap: async direct NVMe I/O through cffi ...").
"""
__all__: list[str] = []
