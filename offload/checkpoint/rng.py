"""The random number generators' states, as a checkpoint and a resume save and restore them.

Imports nothing of ``offload``: the engine and the checkpoint code both take it from here."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's CPU (and, with a GPU, CUDA) generator states."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned (a CUDA state is skipped without a GPU)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
