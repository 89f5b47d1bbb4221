"""The byte layout of a sub-group's state block for each ``offload.state_dtype``.

A state block is one region of the tier (the unit of NVMe I/O). Its layout, for a sub-group
of n elements whose pieces (``SubGroup.pieces``) are the tensors the Adam step is handed:

- fp32: ``[master | exp_avg | exp_avg_sq]``, 3 x n float32 (12 n bytes), as it always was;
- bf16: master float32 (4 n), then exp_avg and exp_avg_sq bfloat16 (2 n each): 8 n bytes;
- int8: master float32 (4 n), exp_avg codes (n), exp_avg_sq codes (n), padding to 4 bytes,
  then exp_avg's block scales and exp_avg_sq's (float32, S each): 6 n + 8 S bytes, where S is
  the sum over the pieces of ceil(piece / 256): each piece's blocks start at its first element
  ([Note: quantized Adam states] in csrc/ofl_adam.h), and its scales follow the previous
  piece's, pieces in ``sub_start`` order.

With ``offload.master_dtype`` bf16 (bf16 or int8 moments only) the master is bfloat16 (2 n) and
everything after it moves up: bf16 6 n bytes, int8 4 n (padded to 4) + 8 S.

Zero bytes are zero moments in every format. ``unpack`` / ``pack`` turn a block into the fp32
``[master | exp_avg | exp_avg_sq]`` and back (checkpoints read and write that form; a bf16 master
is widened exactly, and an fp32 one packed into it is rounded to nearest).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from csrc import ConfigError
from cpu_adam.quant import StateDtype, dequantize, quantize, scale_count
from offload.zero.layout import Piece, SubGroup

logger = logging.getLogger(__name__)

__all__ = ["PieceState", "StateFormat"]


class PieceState(NamedTuple):
    """One piece's views into a resident state block (the scales None unless int8)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scale: torch.Tensor | None
    exp_avg_sq_scale: torch.Tensor | None


def _align4(n: int) -> int:
    return -(-n // 4) * 4


class StateFormat:
    """Sizes and views of the state blocks of one layout's sub-groups in one state dtype."""

    def __init__(self, state_dtype: StateDtype | str = StateDtype.FP32, master_dtype: str = "fp32") -> None:
        self.state_dtype = StateDtype.parse(state_dtype, "offload.state_dtype")
        if master_dtype not in ("fp32", "bf16"):
            raise ConfigError(f'offload.master_dtype must be "fp32" or "bf16", got {master_dtype!r}')
        if master_dtype == "bf16" and self.state_dtype is StateDtype.FP32:
            raise ConfigError('offload.master_dtype "bf16" needs offload.state_dtype "bf16" or "int8"')
        self.master_dtype = torch.bfloat16 if master_dtype == "bf16" else torch.float32
        self._mb = self.master_dtype.itemsize  # master bytes per element

    @property
    def fp32(self) -> bool:
        return self.state_dtype is StateDtype.FP32

    @property
    def name(self) -> str:
        """The two config values this format stands for, for messages."""
        master = "bf16" if self.master_dtype is torch.bfloat16 else "fp32"
        return f"offload.state_dtype {self.state_dtype.value!r}, offload.master_dtype {master!r}"

    def _scales(self, sg: SubGroup) -> int:
        return sum(scale_count(p.numel) for p in sg.pieces)

    def _scales_at(self, n: int) -> int:
        return _align4((self._mb + 2) * n)

    def state_bytes(self, sg: SubGroup) -> int:
        """Bytes of ``sg``'s state block."""
        n = sg.numel
        if self.state_dtype is StateDtype.FP32:
            return 12 * n
        if self.state_dtype is StateDtype.BF16:
            return (self._mb + 4) * n
        return self._scales_at(n) + 8 * self._scales(sg)

    def block_dtype(self) -> torch.dtype:
        """The dtype a block is seen as: float32 (fp32, 3 n elements) or uint8 (its bytes)."""
        return torch.float32 if self.fp32 else torch.uint8

    def block_numel(self, sg: SubGroup) -> int:
        return 3 * sg.numel if self.fp32 else self.state_bytes(sg)

    def master(self, sg: SubGroup, block: torch.Tensor) -> torch.Tensor:
        """The master of the whole sub-group (float32, or bfloat16 with a bf16 master)."""
        n = sg.numel
        return block[:n] if self.fp32 else block[:self._mb * n].view(self.master_dtype)

    def piece(self, sg: SubGroup, block: torch.Tensor, piece: Piece) -> PieceState:
        """The views of one piece (its master, moments and, with int8, block scales)."""
        n, a, b = sg.numel, piece.sub_start, piece.sub_start + piece.numel
        if self.fp32:
            return PieceState(block[a:b], block[n + a:n + b], block[2 * n + a:2 * n + b], None, None)
        at = self._mb * n  # where the moments begin
        master = block[:at].view(self.master_dtype)[a:b]
        if self.state_dtype is StateDtype.BF16:
            m = block[at:at + 2 * n].view(torch.bfloat16)
            v = block[at + 2 * n:at + 4 * n].view(torch.bfloat16)
            return PieceState(master, m[a:b], v[a:b], None, None)
        s_total = self._scales(sg)
        first = sum(scale_count(p.numel) for p in sg.pieces if p.sub_start < a)
        k = scale_count(piece.numel)
        scales_at = self._scales_at(n)
        scales = block[scales_at:scales_at + 8 * s_total].view(torch.float32)
        return PieceState(master, block[at + a:at + b], block[at + n + a:at + n + b],
                          scales[first:first + k], scales[s_total + first:s_total + first + k])

    def unpack(self, sg: SubGroup, block: torch.Tensor) -> torch.Tensor:
        """The block as fp32 ``[master | exp_avg | exp_avg_sq]`` (the block itself when fp32)."""
        if self.fp32:
            return block
        n = sg.numel
        out = torch.zeros(3 * n, dtype=torch.float32)
        out[:n].copy_(self.master(sg, block))
        for p in sg.pieces:
            st = self.piece(sg, block, p)
            a, b = p.sub_start, p.sub_start + p.numel
            if self.state_dtype is StateDtype.BF16:
                out[n + a:n + b].copy_(st.exp_avg)
                out[2 * n + a:2 * n + b].copy_(st.exp_avg_sq)
            else:
                dequantize(st.exp_avg, st.exp_avg_scale, signed=True, out=out[n + a:n + b])
                dequantize(st.exp_avg_sq, st.exp_avg_sq_scale, signed=False, out=out[2 * n + a:2 * n + b])
        return out

    def pack(self, sg: SubGroup, fp32: torch.Tensor, block: torch.Tensor) -> None:
        """Write fp32 ``[master | exp_avg | exp_avg_sq]`` into the block (quantizing where int8)."""
        if self.fp32:
            if fp32.data_ptr() != block.data_ptr():
                block.copy_(fp32)
            return
        n = sg.numel
        self.master(sg, block).copy_(fp32[:n])
        for p in sg.pieces:
            st = self.piece(sg, block, p)
            a, b = p.sub_start, p.sub_start + p.numel
            m, v = fp32[n + a:n + b], fp32[2 * n + a:2 * n + b]
            if self.state_dtype is StateDtype.BF16:
                st.exp_avg.copy_(m)
                st.exp_avg_sq.copy_(v)
            else:
                quantize(m.contiguous(), signed=True, codes=st.exp_avg, scales=st.exp_avg_scale)
                quantize(v.clamp(min=0).contiguous(), signed=False, codes=st.exp_avg_sq, scales=st.exp_avg_sq_scale)
