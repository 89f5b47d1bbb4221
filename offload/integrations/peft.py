"""PEFT (LoRA and the other adapters) on the engine: the adapters train, the frozen base stays out of the
optimizer, and ``save_adapter`` writes the adapters as PEFT's ``save_pretrained`` writes them.

```python
model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=8, target_modules=[...]))
engine, optimizer, _, _ = offload.initialize(model=model, config=config)   # stage 2, or 3 with offload_param
...                                                                         # the usual loop
save_adapter(engine, "out_dir")         # adapter_model.safetensors + adapter_config.json
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), "out_dir")   # no engine needed
```

Nothing here is needed to train: ``initialize`` puts only the parameters that require a gradient (the
adapters) in the optimizer, at every stage; at stage 3 the frozen base weights are partitioned and offloaded
as the rest, in units of their own with no optimizer state ([Note: frozen units] in ``offload.zero.units``).
What stage 3 needs is the save: between steps a partitioned adapter weight is an empty tensor ([Note:
parked params] in ``offload.zero.params``), so ``model.save_pretrained`` called there would write empty
tensors. ``save_adapter`` gathers the units of exactly the tensors PEFT saves (PEFT's own
``get_peft_model_state_dict`` names them), one call for all ranks, and lets rank 0 write.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftModel
from peft.utils import get_peft_model_state_dict

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["save_adapter"]


def _saved_tensors(model: PeftModel, adapters: list[str], save_embedding_layers: Any) -> list[torch.Tensor] | None:
    """The model's own tensors PEFT's ``save_pretrained`` writes for ``adapters``; None when PEFT derives a
    tensor of its own from them (it must then read everything)."""
    state = model.state_dict(keep_vars=True)
    own = {id(v) for v in state.values()}
    out: list[torch.Tensor] = []
    with warnings.catch_warnings():  # save_pretrained warns the user itself
        warnings.simplefilter("ignore")
        for name in adapters:
            picked = get_peft_model_state_dict(model, state_dict=state, adapter_name=name,
                                               save_embedding_layers=save_embedding_layers)
            for value in picked.values():
                if isinstance(value, torch.Tensor):
                    if id(value) not in own:
                        return None
                    out.append(value)
    return out


def save_adapter(engine, save_directory: str, **kwargs: Any) -> None:
    """``engine.module.save_pretrained(save_directory, **kwargs)`` (a ``PeftModel``), the adapters gathered
    first at stage 3; every rank calls it, rank 0 writes (PEFT's ``is_main_process``). The tensors are the
    module's, in the compute dtype (as ``save_16bit_model`` writes the model's)."""
    model = engine.module
    if not isinstance(model, PeftModel):
        raise ConfigError(f"save_adapter needs a PEFT model (peft.get_peft_model) as the engine's module, got "
                          f"{type(model).__name__}; engine.save_16bit_model saves a whole model")
    if "is_main_process" in kwargs:
        raise ConfigError("save_adapter sets is_main_process itself (rank 0 writes); do not pass it")
    engine.settle()  # (offload.step_under_forward: the last step's params all in place)
    stage3 = getattr(engine, "stage3", None)
    held = contextlib.nullcontext()
    if stage3 is not None and kwargs.get("state_dict") is None:
        adapters = kwargs.get("selected_adapters") or list(model.peft_config)
        tensors = _saved_tensors(model, adapters, kwargs.get("save_embedding_layers", "auto"))
        if tensors is None:
            logger.warning("save_adapter: PEFT derives the saved tensors from the model's: every unit is gathered "
                           "for the save")
            units = range(len(stage3.layout.buckets))
        else:
            units = stage3.coordinator.units_of(tensors)
        held = stage3.coordinator.gathered_units(units, free=True)  # [Note: parked params]: empty until then
    with held, torch.no_grad():
        model.save_pretrained(save_directory, is_main_process=engine.global_rank == 0, **kwargs)
    if dist.is_initialized():
        dist.barrier()
    if engine.global_rank == 0:
        logger.info("saved the adapters (%s) of the engine's PEFT model to %s",
                    ", ".join(kwargs.get("selected_adapters") or model.peft_config), save_directory)
