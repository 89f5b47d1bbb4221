"""The undo copy of compressed-state Adam passes: a kill inside one is finished by the restart.

[Note: block undo] The C undo log ([Note: undo log] in ``csrc/adam_undo.c``) knows the fp32
state's layout (master, exp_avg, exp_avg_sq). With ``offload.state_dtype`` bf16 or int8 a state
block is a master and compressed moments with their scales (``offload.zero.state_format``), which
the log does not cover. So before such a block's Adam pass its bytes are copied whole into
region ``engine.undo.block`` of the daemon session, and a word ahead of the copy names the
sub-group whose copy is whole:

    offset  size  field
    0       8     sub-group whose copy is whole, or -1
    8       56    reserved (0)
    64      n     the block's bytes as its pass began

Order: ``begin`` (before the step record says the pass runs) sets -1; ``save`` copies, then
writes the index; then the pass runs. A restart that finds sub-group ``i``'s pass running
(the step record's ``in_pass``) restores the copy if the word says ``i``, and else leaves the
block as it is (the copy was not whole, so the pass had not started: the block is untouched);
then runs the pass whole. The word is reset at every pass, so a copy left by an earlier pass of
the same sub-group is never taken for this one's.

Cost: a copy of the block (6.03 bytes per parameter with int8 moments, 8 with bf16; 2 fewer each
with ``offload.master_dtype`` bf16) per pass,
``tools/bench/results/step-record-undo_2core-epyc_202611.md``.
"""
from __future__ import annotations

from typing import Any

import torch

from csrc import ConfigError

__all__ = ["BLOCK_UNDO_NAME", "BlockUndo", "block_undo_bytes", "open_block_undo"]

BLOCK_UNDO_NAME = "engine.undo.block"
_HEAD = 64
_NONE = -1


def block_undo_bytes(max_block_bytes: int) -> int:
    """Bytes of the region for blocks of up to ``max_block_bytes``."""
    return _HEAD + max_block_bytes


class BlockUndo:
    """The copy of [Note: block undo] over a writable buffer (shared memory, in the engine)."""

    def __init__(self, buffer: Any, *, fresh: bool) -> None:
        self._keep = buffer
        self._word = torch.frombuffer(buffer, dtype=torch.int64, count=1)
        self._bytes = torch.frombuffer(buffer, dtype=torch.uint8, offset=_HEAD)
        if fresh:
            self._word[0] = _NONE

    def begin(self) -> None:
        """A new pass: no copy is whole."""
        self._word[0] = _NONE

    def save(self, sg: int, state: torch.Tensor) -> None:
        """Sub-group ``sg``'s block, before its pass writes it."""
        data = _bytes_of(state)
        if data.numel() > self._bytes.numel():
            raise ConfigError(f"sub-group {sg}'s state block is {data.numel()} bytes, over the undo copy's "
                              f"{self._bytes.numel()}")
        self._bytes[:data.numel()].copy_(data)
        self._word[0] = sg

    def restore(self, sg: int, state: torch.Tensor) -> bool:
        """Put back sub-group ``sg``'s block as its cut pass began; False if no whole copy of it is held (its
        pass had not started writing)."""
        if int(self._word[0]) != sg:
            return False
        data = _bytes_of(state)
        data.copy_(self._bytes[:data.numel()])
        return True

    def release(self) -> None:
        self._word = self._bytes = self._keep = None


def _bytes_of(state: torch.Tensor) -> torch.Tensor:
    return state.reshape(-1).view(torch.uint8)


def open_block_undo(store: Any, *, existing: bool, max_block_bytes: int) -> BlockUndo:
    """The session's block undo copy for blocks of up to ``max_block_bytes``, or the one a previous
    process of the session left."""
    if not existing:
        store.allocate(BLOCK_UNDO_NAME, block_undo_bytes(max_block_bytes))
    return BlockUndo(store.host_view(BLOCK_UNDO_NAME), fresh=not existing)
