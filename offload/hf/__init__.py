"""Hugging Face models: built under ``init_context`` with their own init, loaded from safetensors straight
into the partitions, and saved back as safetensors that load without this engine.

- ``init_context``: ``offload.init_context(config)``, a model no process holds whole (DeepSpeed's ``zero.Init``);
- ``model_init``: the model's own ``_init_weights`` replayed into stage 3's partitions;
- ``from_pretrained``: transformers' ``from_pretrained`` inside the context, the engine loading;
- ``load``: ``offload.load_pretrained``, a local safetensors checkpoint tensor by tensor;
- ``names``: checkpoint names against the model's, as transformers converts them;
- ``save``, ``safetensors_out``: ``engine.save_16bit_model`` and the sharded safetensors it writes.
"""
