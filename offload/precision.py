"""Mixed precision: the loss scale (static or dynamic), overflow, and the clip coefficient.

The engine keeps gradients summed over ranks and scaled by the loss scale; it never
rescales them in place. One number, ``grad_multiplier``, turns the sum into the
averaged, unscaled, clipped gradient inside the fused Adam pass:
``1 / (loss_scale * world_size) * clip_coefficient``.
"""
from __future__ import annotations

import dataclasses
import logging
import math

logger = logging.getLogger(__name__)

__all__ = ["LossScaler", "LossScalerConfig", "clip_coefficient"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """fp16 loss scaling, with DeepSpeed's meaning of each field."""

    dynamic: bool = True
    """Lower the scale on overflow and raise it after a window without one."""
    static_scale: float = 1.0
    """The scale when not dynamic (1.0 for fp32 and bf16)."""
    initial_scale_power: int = 16
    """A dynamic scale starts at 2**initial_scale_power."""
    window_steps: int = 1000
    """Steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow (not only at a window)."""
    min_scale: float = 1.0
    """The scale is never halved below this."""

    def __post_init__(self) -> None:
        if not self.static_scale > 0 or not self.min_scale > 0:
            raise ValueError("static_scale and min_scale must be > 0")
        if self.window_steps < 1 or self.hysteresis < 1:
            raise ValueError("window_steps and hysteresis must be >= 1")


class LossScaler:
    """The current loss scale and its update rule (DeepSpeed's dynamic loss scaler's semantics)."""

    def __init__(self, config: LossScalerConfig) -> None:
        self.config = config
        self.scale = float(2 ** config.initial_scale_power) if config.dynamic else config.static_scale
        self._hysteresis = config.hysteresis
        self._iteration = 0
        self._last_overflow = -1

    def update(self, overflow: bool) -> None:
        """After a boundary step: lower on overflow (after hysteresis), raise after a clean window."""
        c = self.config
        if not c.dynamic:
            return
        if overflow:
            if self._hysteresis <= 1:
                new = max(self.scale / 2.0, c.min_scale)
                logger.info("fp16 overflow: loss scale %g -> %g", self.scale, new)
                self.scale = new
            else:
                self._hysteresis -= 1
                logger.info("fp16 overflow: loss scale kept at %g (hysteresis %d left)", self.scale, self._hysteresis)
            self._last_overflow = self._iteration
        else:
            if c.consecutive_hysteresis:
                self._hysteresis = c.hysteresis
            if (self._iteration - self._last_overflow) % c.window_steps == 0:
                if not c.consecutive_hysteresis:
                    self._hysteresis = c.hysteresis
                self.scale *= 2.0
        self._iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis": self._hysteresis, "iteration": self._iteration,
                "last_overflow": self._last_overflow}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis = int(state["hysteresis"])
        self._iteration = int(state["iteration"])
        self._last_overflow = int(state["last_overflow"])


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` rule: scale by max_norm / (norm + 1e-6) when that is below 1."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
