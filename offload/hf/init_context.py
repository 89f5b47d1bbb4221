"""``offload.init_context(config)``: build a model that no process holds whole (DeepSpeed's ``zero.Init``).

(The module is named meta_init so that ``offload.init_context`` stays the function.)

Inside the context, modules are constructed on the meta device: their parameters have shapes
and no memory. ``offload.initialize`` (stage 3) then puts each parameter straight into its
partition, one module at a time ([Note: materializing] in ``offload.zero.stage3``), by
running the module's ``reset_parameters()`` or the ``param_init_fn`` given here; a Hugging Face
model's own ``_init_weights`` runs instead, replayed in the order ``post_init`` runs it
([Note: init replay] in ``offload.hf.model_init``). ``from_pretrained`` of a local safetensors directory works
inside the context too: the weights are read into the partitions at ``initialize``
([Note: from_pretrained in the context] in ``offload.hf.from_pretrained``).

    with offload.init_context(config):
        model = GPT(cfg)
    engine, optimizer, _, _ = offload.initialize(model=model, config=config)
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Iterator

import torch

from csrc import ConfigError
from offload.hf.model_init import recording
from offload.hf.from_pretrained import from_pretrained_in_context

logger = logging.getLogger(__name__)

__all__ = ["init_context", "init_fn_of", "init_record_of"]

# Models built in a context with a param_init_fn -> that function (a side table: nothing is set on the model).
_INIT_FNS: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()
# Models built in a context -> what the context recorded ([Note: init replay]), shared by the context's models.
_RECORDS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()

def _stage_of(config: Any) -> int:
    if config is None:
        return 3
    from offload.config import read_config

    return read_config(config, world_size=max(1, _world())).zero.stage


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def init_context(config: Any = None, *, param_init_fn: Callable[[torch.nn.Module], None] | None = None,
                 enabled: bool = True) -> Iterator[None]:
    """Construct modules on the meta device. ``config`` (the engine's, checked now) must be stage 3;
    ``param_init_fn(module)`` fills a module's own parameters where it has no ``reset_parameters``.
    ``enabled=False`` builds the model the plain way (as DeepSpeed's flag)."""
    if not enabled:
        yield
        return
    stage = _stage_of(config)
    if stage != 3:
        raise ConfigError(f"init_context needs zero_optimization.stage 3, the config says {stage}")
    before = torch.nn.Module.__init__
    built: list[weakref.ref] = []

    def record(self, *args, **kwargs):  # remember every module made here, to find the roots after
        before(self, *args, **kwargs)
        built.append(weakref.ref(self))

    events: list = []
    torch.nn.Module.__init__ = record
    try:
        with torch.device("meta"), recording(events), from_pretrained_in_context():
            yield
    finally:
        torch.nn.Module.__init__ = before
    for ref in built:
        module = ref()
        if module is not None:
            _RECORDS[module] = events
    if param_init_fn is not None:
        for ref in built:
            module = ref()
            if module is not None:
                _INIT_FNS[module] = param_init_fn


def init_record_of(model: torch.nn.Module) -> list | None:
    """What the context ``model`` was built in recorded: its draws and ``init_weights`` calls, in order."""
    return _RECORDS.get(model)


def init_fn_of(model: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """The ``param_init_fn`` of the context ``model`` was built in, if any."""
    return _INIT_FNS.get(model)
