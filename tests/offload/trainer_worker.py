"""A rank of test_trainer's torchrun test: ``trainer_worker.py plain|offload OUT``. The plain Trainer (DDP over
gloo) or OffloadTrainer at stage 2 trains the tiny GPT-2 with per-rank batches of 2 and evaluation every 2 steps;
rank 0 writes the log history to OUT/log.json. The offload run also saves the model to OUT/saved and writes the
trained model's logits to OUT/logits.pt."""
from __future__ import annotations

import json
import os
import sys

import torch
from transformers import Trainer

from offload.integrations.transformers import OffloadTrainer
from tests.offload import hf_models as hf
from tests.offload import trainer_common as tc


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    args = tc.args(out, per_device_train_batch_size=2, eval_strategy="steps", eval_steps=2, ddp_backend="gloo")
    if mode == "plain":
        trainer = tc.train(Trainer, hf.build("gpt2"), args, eval_n=8)
    else:
        trainer = tc.train(OffloadTrainer, hf.build("gpt2"), args, eval_n=8,
                           offload_config=tc.offload_config(2, "cpu"))
        assert trainer.offload_engine.world_size == 2
        trainer.save_model(os.path.join(out, "saved"))
        with torch.no_grad():
            logits = trainer.model_wrapped.eval()(input_ids=tc.Repeated(4, seed=3).ids).logits
        if trainer.args.process_index == 0:
            torch.save(logits, os.path.join(out, "logits.pt"))
    if trainer.args.process_index == 0:
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    trainer.end()


if __name__ == "__main__":
    main()
