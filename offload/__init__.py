"""The training side: ``initialize()``, the engine, ZeRO partitioning, checkpoints, the CLI.

```python
import offload
engine, optimizer, loader, lr_scheduler = offload.initialize(model=model, config="ds_config.json",
                                                                training_data=dataset)
for batch in loader:
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
```

The config is DeepSpeed's (``offload.config`` reads it; an unknown key is an error naming
it). Also re-exports the exception family (as ``csrc.errors.__all__`` lists it, less the C
helper ``raise_errno``), so a training script catches ``offload.OffloadError`` or a
subclass whatever layer raised it.
"""
from csrc import errors as _errors
from csrc.errors import *  # noqa: F401,F403

# The engine's names load on first use, so `offload daemon` and `offload status` start without torch.
_LAZY = {"Engine": "offload.engine", "EngineStats": "offload.engine", "EngineConfig": "offload.config",
         "read_config": "offload.config", "init_distributed": "offload.builder", "add_config_arguments": "offload.builder", "initialize": "offload.builder",
         "init_context": "offload.hf.init_context",
         "load_pretrained": "offload.hf.load", "LoadReport": "offload.hf.load", "register_external_parameter": "offload.zero.external",
         "unregister_external_parameter": "offload.zero.external"}

__all__ = [name for name in _errors.__all__ if name != "raise_errno"] + sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
