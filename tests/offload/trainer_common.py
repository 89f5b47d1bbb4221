"""What the HF Trainer tests and their torchrun worker share: the tiny data, the arguments, the configs and a run.
Importing this needs transformers: test modules importorskip it first."""
from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments

from tests.offload import hf_models as hf

SEQS = 4  # distinct sequences the data repeats: a tiny model learns them, so the losses move


class Repeated(torch.utils.data.Dataset):
    """``n`` samples cycling over ``SEQS`` fixed random token sequences (labels = inputs)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, hf.VOCAB, (SEQS, hf.SEQ), generator=g)
        self.ids = base[torch.arange(n) % SEQS]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(out: str, **kw) -> TrainingArguments:
    """Trainer arguments for the tiny runs: AdamW (the Trainer's default, torch's fused one), a linear schedule
    with warm-up, clipping at 1.0, a log line every step, no saving unless asked."""
    base = dict(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=6,
                learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, logging_steps=1, report_to=[],
                save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, use_cpu=True,
                dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def offload_config(stage: int, device: str, nvme_path: str | None = None, **top) -> dict:
    """A DeepSpeed config as HF users write it: every Trainer-owned value "auto", no optimizer or scheduler
    section (the Trainer's are used)."""
    where = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    zero = {"stage": stage, "offload_optimizer": dict(where), "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(offload_param=dict(where), stage3_prefetch_bucket_size="auto",
                    stage3_param_persistence_threshold="auto")
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
              "zero_optimization": zero}
    config.update(top)
    return config


def train(cls, model, training_args, *, train_n: int = 24, eval_n: int = 0, **kw) -> Trainer:
    trainer = cls(model=model, args=training_args, train_dataset=Repeated(train_n),
                  eval_dataset=Repeated(eval_n, seed=2) if eval_n else None, **kw)
    trainer.train()
    return trainer


def logged(trainer: Trainer, key: str) -> list[float]:
    """``key`` (loss, grad_norm, learning_rate, eval_loss) at every step the Trainer logged it."""
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]
