"""``from_pretrained`` inside ``offload.init_context``: transformers builds the model, the engine loads it.

    with offload.init_context(config):
        model = AutoModelForCausalLM.from_pretrained("path/to/model_dir")   # a local directory
    engine, *_ = offload.initialize(model=model, config=config)

[Note: from_pretrained in the context] transformers 5's ``from_pretrained`` resolves the config, the
checkpoint files, the dtype (``"auto"``: the checkpoint's) and the weight conversions, and builds the
model under its own init contexts (on the meta device here, inside ours, so ``init_context`` records the
constructors' draws and ``post_init`` as for ``from_config``). Then it calls two static methods of
``PreTrainedModel``: ``_load_pretrained_model(model, state_dict, checkpoint_files, load_config)``, which
maps every file and puts every tensor into the model (the whole model in host memory), and
``_finalize_model_loading(model, load_config, loading_info)``, which materializes and initializes the
missing keys, ties the weights and logs the report. The only seam transformers has between the two for a
sharded engine is DeepSpeed's (``is_deepspeed_zero3_enabled()``: it imports ``deepspeed`` and reads and
writes ``ds_*`` attributes on every parameter), so while the context is open those two methods are the
engine's, on the class (as ``init_weights`` is for [Note: init replay]); outside it they are transformers'
own again. The load is ``offload.load_pretrained(model, checkpoint_files, conversions=...)`` with
from_pretrained's weight conversions (a pending load: each rank reads its pieces at ``initialize``); the
finalize keeps what applies to a meta model: the weights are tied (before the load, so a tied name is
satisfied by any of its names) and the missing and unexpected keys go through the model's ignore
patterns into from_pretrained's ``output_loading_info``. The result is the model ``from_config`` +
``load_pretrained`` gives: the model's whole init replays at ``initialize`` and the checkpoint overwrites
what it has (plain ``from_pretrained`` draws only for the missing keys, so a missing key's random values
differ from plain ``from_pretrained``'s; loaded ones are equal). Refused, with the reason: ``state_dict=``,
``device_map``, quantization, tensor parallelism, and checkpoints that are not safetensors (``.bin``, GGUF).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from csrc import ConfigError
from offload.hf.model_init import _pretrained_class

logger = logging.getLogger(__name__)

__all__ = ["from_pretrained_in_context"]


def _meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


_REFUSED_KWARGS = {"state_dict": "is not read (save it with safetensors and pass the directory)",
                   "device_map": "places the weights itself; leave it out (the engine places them)",
                   "quantization_config": "asks for quantized weights, which the engine does not hold",
                   "tp_plan": "asks for tensor parallelism, which is not combined with the engine's partitions",
                   "distributed_config": "asks for tensor parallelism, which is not combined with the engine's "
                                         "partitions",
                   "gguf_file": "names a GGUF file; the engine reads safetensors"}


def _no(what: str) -> ConfigError:
    return ConfigError(f"from_pretrained inside offload.init_context: {what}; the engine reads local "
                       "safetensors into its partitions (load the model outside the context otherwise)")


def _refuse(state_dict: Any, checkpoint_files: list | None, load_config: Any) -> None:
    no = _no
    if state_dict is not None:
        raise no("state_dict= is not read (save it with safetensors and pass the directory)")
    if getattr(load_config, "device_map", None) is not None:
        raise no("device_map places the weights itself; leave it out (the engine places them)")
    if getattr(load_config, "hf_quantizer", None) is not None:
        raise no("quantized checkpoints are not read")
    if getattr(load_config, "device_mesh", None) is not None:
        raise no("tensor parallelism (a device mesh) is not combined with the engine's partitions")
    if not checkpoint_files:
        raise no("transformers found no checkpoint files")
    other = [f for f in checkpoint_files if not str(f).endswith(".safetensors")]
    if other:
        raise no(f"{other[0]} is not a .safetensors file")


def _load(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """``PreTrainedModel._load_pretrained_model`` inside the context ([Note: from_pretrained in the context])."""
    from transformers.utils.loading_report import LoadStateDictInfo

    from offload.hf.load import load_pretrained

    if not _meta(model):
        raise ConfigError("from_pretrained inside offload.init_context built a model with real parameters "
                          f"({type(model).__name__}); the engine loads only models built on the meta device")
    _refuse(state_dict, checkpoint_files, load_config)
    model.tie_weights(recompute_mapping=False)  # from_pretrained builds under no_tie_weights() and ties after
    conversions = list(getattr(load_config, "weight_mapping", None) or [])
    report = load_pretrained(model, list(checkpoint_files), conversions=conversions)
    model._weight_conversions = [c for c in conversions if c.was_used()]  # as transformers keeps them for saving
    info = LoadStateDictInfo(missing_keys=set(report.missing_keys), unexpected_keys=set(report.unexpected_keys),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    return info, None


def _finalize(model, load_config, loading_info):
    """``PreTrainedModel._finalize_model_loading`` inside the context: the init and the values come at
    ``initialize``; only the report is adjusted."""
    model._adjust_missing_and_unexpected_keys(loading_info)
    return loading_info


@contextlib.contextmanager
def from_pretrained_in_context() -> Iterator[None]:
    """While open, transformers' ``from_pretrained`` loads through the engine (when transformers is imported)."""
    pretrained = _pretrained_class()
    if pretrained is None:
        yield
        return
    for name in ("_load_pretrained_model", "_finalize_model_loading"):
        if not callable(getattr(pretrained, name, None)):
            raise ConfigError(f"this transformers version has no PreTrainedModel.{name}, which from_pretrained "
                              "inside offload.init_context replaces; build with from_config and call "
                              "offload.load_pretrained instead")
    names = ("from_pretrained", "_load_pretrained_model", "_finalize_model_loading")
    before = {name: pretrained.__dict__[name] for name in names}
    plain = before["from_pretrained"].__func__

    def from_pretrained(cls, *args, **kwargs):
        for key, what in _REFUSED_KWARGS.items():
            if kwargs.get(key) is not None:
                raise _no(f"{key}= {what}")
        with torch.device("cpu"):  # transformers refuses an ambient meta device; it builds on meta itself
            return plain(cls, *args, **kwargs)

    pretrained.from_pretrained = classmethod(from_pretrained)
    pretrained._load_pretrained_model = staticmethod(_load)
    pretrained._finalize_model_loading = staticmethod(_finalize)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(pretrained, name, value)
