"""The frameworks people train with, on the engine: the HF Trainer (and its subclasses: TRL's SFTTrainer),
Accelerate, Lightning, PEFT's LoRA models. Each module imports its framework, an optional extra
(``.[hf]``, ``.[lightning]``); nothing here is imported by the core."""
