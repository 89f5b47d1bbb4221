"""Tiny Hugging Face models for the engine's tests (built from configs here: nothing is downloaded), the
configs and the plain-torch oracle. Importing this needs transformers: test modules importorskip it first."""
from __future__ import annotations

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

VOCAB = 97
SEQ = 12
BATCH = 4
LR = 3e-3


def gpt2_config() -> GPT2Config:
    """GPT-2 (Conv1D layers, a head tied to the embedding), no dropout so runs compare step by step."""
    return GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def llama_config() -> LlamaConfig:
    """Llama (RMSNorm, rotary buffers, GQA: 4 heads over 2 key/value heads, an untied head)."""
    return LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def mixtral_config() -> MixtralConfig:
    """Mixtral (4 experts, 1 per token: most experts see few or no tokens in a step; no aux loss)."""
    return MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, router_aux_loss_coef=0.0, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)


BUILDERS = {"gpt2": (GPT2LMHeadModel, gpt2_config), "llama": (LlamaForCausalLM, llama_config),
            "mixtral": (MixtralForCausalLM, mixtral_config)}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    cls, config = BUILDERS[kind]
    torch.manual_seed(seed)
    return cls(config())


def batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def engine_config(stage: int, device: str, workdir: str, **zero) -> dict:
    """AdamW, clipping; the optimizer (and at stage 3 the params) offloaded to ``device`` (cpu or nvme)."""
    where = {"device": device, **({"nvme_path": workdir} if device == "nvme" else {})}
    section = {"stage": stage, "offload_optimizer": where, "sub_group_size": 4096, **zero}
    if stage == 3:
        section.update(offload_param=dict(where), stage3_param_persistence_threshold=100)
    return {"train_batch_size": BATCH, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": section}


def torch_losses(model: torch.nn.Module, data: list[torch.Tensor]) -> list[float]:
    """The oracle: torch.optim.AdamW with the same clipping."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def engine_losses(engine, data: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def torch_mixed_losses(model: torch.nn.Module, data: list[torch.Tensor], dtype: torch.dtype) -> list[float]:
    """The mixed-precision oracle (as ``harness.run_mixed``): a ``dtype`` copy computes forward and backward,
    AdamW steps fp32 masters on the clipped fp32 gradients, the masters are rounded back."""
    master = copy.deepcopy(model).float()
    low = copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for ids in data:
        low.zero_grad(set_to_none=True)
        loss = low(input_ids=ids, labels=ids).loss
        loss.backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for p, q in zip(master.parameters(), low.parameters()):
                q.copy_(p)
        losses.append(loss.item())
    return losses


def build_meta(kind: str, config: dict, seed: int = 0) -> torch.nn.Module:
    """``kind`` built under ``offload.init_context(config)`` after seeding as ``build`` does."""
    from offload import init_context

    cls, model_config = BUILDERS[kind]
    torch.manual_seed(seed)
    with init_context(config):
        return cls(model_config())


def train_own_slices(engine, steps: int) -> list[float]:
    """``steps`` optimizer steps of a causal LM on ``batches(steps)``, each rank on its own slice of the batch."""
    rank, world = engine.global_rank, engine.world_size
    per_rank = BATCH // world
    losses = []
    for ids in batches(steps):
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
