"""The HF step bench's arithmetic, apart from any GPU: the Llama shapes it trains, the engine config
``offload estimate`` picks for a machine, the config DeepSpeed gets there, and the model FLOPs.

[Note: the estimate's pick] Ours runs with the first of ``CHOICES`` (fastest first: the fewer bytes
moved and the less offloaded, the sooner) whose ``offload estimate`` row fits the machine: every
memory within ``headroom`` of it (the GPU's total, the host's available memory, the free disk
under the swap path). So the bench's config is what the estimate tells a user on that node, and a
size that fits in no row is named with what is short, not run.

[Note: DeepSpeed's bytes] DeepSpeed's ZeRO-Offload keeps fp32 master, moments and gradients of the
offloaded share in host memory, 16 bytes a parameter (its ZeRO-Offload paper's and its docs' 16 P;
the bf16 gradients' pinned staging adds 2 more), fp32 only: it has no 8-bit moments and no bf16
master. Its ZeRO-3 ``offload_optimizer.ratio`` (the share on the CPU; the rest is stepped on the GPU,
its "Twin-Flow") is what lets it fit where 16 bytes a parameter do not: its row takes ZeRO-2 where
that fits, else ZeRO-3 with the largest ratio (of 1.0, 0.9, ... 0.1) whose host share fits, its GPU
holding the bf16 params, the GPU share's 16 bytes and the activations; none that fits is named.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

__all__ = ["CHOICES", "SHAPES", "Choice", "LlamaShape", "choose", "deepspeed_choice", "engine_config", "hf_config",
           "model_flops_per_token"]

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """A Llama-shaped causal LM (untied embeddings, grouped-query attention, SwiGLU MLP)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int


SHAPES = {
    "8b": LlamaShape(32, 4096, 14336, 32, 8, 128256),  # Llama 3.1 8B's: 8.03B
    "14b": LlamaShape(48, 5120, 13824, 40, 8, 152064),  # Qwen2.5 14B's widths in Llama's form: 14.77B
    "30b": LlamaShape(56, 6656, 17920, 52, 52, 32000),  # LLaMA 30B's widths, 56 layers: 30.39B
    "tiny": LlamaShape(2, 64, 176, 4, 2, 256),
}


def hf_config(shape: LlamaShape, *, seq: int) -> Any:
    """The ``transformers.LlamaConfig`` of ``shape`` (bf16, positions up to ``seq``)."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=shape.layers, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                       max_position_embeddings=seq, tie_word_embeddings=False, dtype="bfloat16", use_cache=False)


def params_of(shape: LlamaShape) -> tuple[int, int]:
    """(all parameters, the input embedding's): counted from the shapes, as the model's own count."""
    head_dim = shape.hidden // shape.heads
    attn = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * shape.kv_heads * head_dim
    per_layer = attn + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    embed = shape.vocab * shape.hidden
    return shape.layers * per_layer + 2 * embed + shape.hidden, embed


def model_flops_per_token(shape: LlamaShape, *, seq: int) -> float:
    """6 N + 12 L d T ([Note: model FLOPs] in step_gpu_plan.py) with N less the input embedding, a lookup that
    multiplies nothing (the untied head's matmul is counted). Recomputation under gradient checkpointing is
    work the GPU does, not the model's: not counted."""
    total, embed = params_of(shape)
    return float(6 * (total - embed) + 12 * shape.layers * shape.hidden * seq)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One engine configuration the bench may run (``offload estimate``'s row keys and storage)."""

    name: str
    stage: int
    optimizer: str = "cpu"
    param: str = "none"
    state_dtype: str = "fp32"
    master_dtype: str = "fp32"
    grad_accum_dtype: str = "fp32"
    gradient_tier: str = "auto"
    ratio: float = 1.0
    """offload_optimizer.ratio: the share offloaded, the rest kept on the GPU ([Note: GPU-resident share])."""


CHOICES = (
    Choice("z1-opt-cpu-half", 1, ratio=0.5),
    Choice("z1-opt-cpu", 1),
    Choice("z1-opt-cpu-int8", 1, state_dtype="int8", grad_accum_dtype="bf16"),
    Choice("z1-opt-cpu-lean", 1, state_dtype="int8", master_dtype="bf16", grad_accum_dtype="bf16"),
    Choice("z3-opt-cpu-lean", 3, state_dtype="int8", master_dtype="bf16", grad_accum_dtype="bf16"),
    Choice("z3-param-cpu-lean", 3, param="cpu", state_dtype="int8", master_dtype="bf16", grad_accum_dtype="bf16"),
    # the state in host memory, the accumulators on NVMe: written and read at every micro-batch
    Choice("z3-opt-cpu-lean-grads-nvme", 3, state_dtype="int8", master_dtype="bf16", grad_accum_dtype="bf16",
           gradient_tier="nvme"),
    Choice("z3-opt-nvme-lean", 3, optimizer="nvme", state_dtype="int8", master_dtype="bf16", grad_accum_dtype="bf16"),
    Choice("z3-nvme-lean", 3, optimizer="nvme", param="nvme", state_dtype="int8", master_dtype="bf16",
           grad_accum_dtype="bf16"),
)
"""Fastest first ([Note: the estimate's pick]): half of the fp32 state on the GPU where it fits there (half
the CPU's Adam and of the bytes moved, and the GPU's fused AdamW on the rest), then all of it on the host,
then smaller host states. Stage 1, not 2, where the params stay on the GPU: with one rank
both hold the same bytes, but stage 1 accumulates the micro-batches' gradients in the GPU's flat buffer and
moves them to the host once a step, stage 2 at every micro-batch (``offload.zero.grads``)."""


def engine_config(choice: Choice, *, micro_batch: int, accum: int, nvme_path: str, lr: float = 1e-4) -> dict:
    """The engine's JSON config for ``choice`` (DeepSpeed's keys; ``offload``, ``data_types`` ours)."""
    def where(device: str, buffers: int) -> dict:
        return {"device": device, **({"nvme_path": nvme_path, "buffer_count": buffers} if device == "nvme" else {})}

    zero = {"stage": choice.stage, "offload_optimizer": where(choice.optimizer, 4), "sub_group_size": 100_000_000,
            "reduce_bucket_size": 50_000_000}
    if choice.ratio != 1.0:
        zero["offload_optimizer"]["ratio"] = choice.ratio
    if choice.gradient_tier == "nvme":  # the accumulators' swap file goes under the optimizer's nvme_path
        zero["offload_optimizer"]["nvme_path"] = nvme_path
    if choice.stage == 3:
        zero["offload_param"] = where(choice.param, 5)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accum,
              "steps_per_print": 10 ** 9, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
              "zero_optimization": zero}
    offload = {k: v for k, v in (("state_dtype", choice.state_dtype), ("master_dtype", choice.master_dtype),
                                 ("gradient_tier", choice.gradient_tier)) if v not in ("fp32", "auto")}
    if offload:
        config["offload"] = offload
    if choice.grad_accum_dtype != "fp32":
        config["data_types"] = {"grad_accum_dtype": choice.grad_accum_dtype}
    return config


def activation_elements(shape: LlamaShape, *, micro_batch: int, seq: int) -> int:
    """Activations with gradient checkpointing, in compute-dtype elements: each layer's saved input, one
    layer's working set while it is recomputed (its widest tensors, about 16 of hidden width), and the
    logits with their fp32 loss copies (about 5 of vocab width)."""
    tokens = micro_batch * seq
    return tokens * (shape.layers * shape.hidden + 16 * shape.hidden + 2 * shape.intermediate + 5 * shape.vocab)


@functools.lru_cache(maxsize=64)
def model_shapes(shape: LlamaShape, *, micro_batch: int, seq: int) -> Any:
    """``offload.plan.estimate.ModelShapes`` of the model built on the meta device (seconds at 30B: kept)."""
    import torch
    from transformers import AutoModelForCausalLM

    from offload.plan.estimate import shapes_from_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(shape, seq=seq))
    return shapes_from_model(model, persistence_threshold=100_000,
                             activation_elements=activation_elements(shape, micro_batch=micro_batch, seq=seq))


def _row(choice: Choice, shape: LlamaShape, *, micro_batch: int, seq: int, machine: Any, nvme_path: str):
    from offload.plan.estimate import EstimateInput, estimate

    shapes = model_shapes(shape, micro_batch=micro_batch, seq=seq)
    inp = EstimateInput.from_config(engine_config(choice, micro_batch=micro_batch, accum=1, nvme_path=nvme_path),
                                    shapes, gpu=machine.gpu, baseline_bytes=0)
    inp = dataclasses.replace(inp, available_host_bytes=machine.host_bytes)
    return estimate(inp, stages=(choice.stage,)).row(stage=choice.stage, optimizer=choice.optimizer,
                                                     param=choice.param)


def _scaled(machine: Any, headroom: float) -> Any:
    return dataclasses.replace(machine, host_bytes=int(headroom * machine.host_bytes),
                               nvme_bytes=int(headroom * machine.nvme_bytes),
                               gpu_bytes=None if machine.gpu_bytes is None else int(headroom * machine.gpu_bytes))


def choose(shape: LlamaShape, *, micro_batch: int, seq: int, machine: Any, nvme_path: str = "/tmp",
           headroom: float = 0.85) -> tuple[Choice | None, list[str]]:
    """The first of ``CHOICES`` that fits ``machine`` (an ``offload.plan.fit.Machine``) within ``headroom``
    of each memory, and a line per row tried ([Note: the estimate's pick])."""
    from offload.plan.fit import verdict

    room = _scaled(machine, headroom)
    tried = []
    for choice in CHOICES:
        row = _row(choice, shape, micro_batch=micro_batch, seq=seq, machine=room, nvme_path=nvme_path)
        v = verdict(row, room)
        tried.append(f"{choice.name}: GPU {row.device_bytes / GIB:.1f} GiB, host {row.host_bytes / GIB:.1f} GiB, "
                     f"NVMe {row.nvme_bytes / GIB:.1f} GiB: {'fits' if v.fits else v.text()}")
        if v.fits:
            return choice, tried
    return None, tried


def deepspeed_choice(shape: LlamaShape, *, micro_batch: int, seq: int, machine: Any,
                     headroom: float = 0.85) -> tuple[dict | None, str]:
    """DeepSpeed's zero_optimization (stage, offload, ratio) for this machine, and why ([Note: DeepSpeed's
    bytes]); None where no ratio fits."""
    total, _ = params_of(shape)
    act = 2 * activation_elements(shape, micro_batch=micro_batch, seq=seq)
    host = headroom * machine.host_bytes
    gpu = headroom * machine.gpu_bytes if machine.gpu_bytes is not None else float("inf")
    if 18 * total <= host and 2 * total + act <= gpu:
        return {"stage": 2, "offload_optimizer": {"device": "cpu"}}, \
            f"ZeRO-2: host {18 * total / GIB:.1f} GiB (18 B/param) within {host / GIB:.1f}"
    for tenths in range(10, 0, -1):
        ratio = tenths / 10
        on_host, on_gpu = 18 * total * ratio, 2 * total + 16 * total * (1 - ratio) + act
        if on_host <= host and on_gpu <= gpu:
            zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}
            return zero, (f"ZeRO-3, ratio {ratio}: host {on_host / GIB:.1f} GiB within {host / GIB:.1f}, GPU "
                          f"{on_gpu / GIB:.1f} GiB within {gpu / GIB:.1f}")
    return None, (f"no ZeRO-3 ratio fits: 18 B/param on the host need {18 * total / GIB:.1f} GiB of "
                  f"{host / GIB:.1f}, and the GPU cannot take the rest")
