"""The HF Trainer through the engine (offload.integrations.transformers): OffloadTrainer against the plain Trainer
(torch's AdamW, fp32) on the same tiny model, data and seed. The logged losses, gradient norms and learning
rates agree to 1e-4 relative at every step: stage 2 with the optimizer in host memory, stage 3 with params and
optimizer on NVMe from from_pretrained inside init_context, gradient accumulation with a short last cycle,
gradient checkpointing, TRL's SFTTrainer through the mixin and two ranks under torchrun; evaluation during
training gives the same eval losses. save_model writes what from_pretrained loads; a run stopped at a checkpoint
and resumed from it ends with the uninterrupted run's parameters, bit for bit."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")

from transformers import AutoModelForCausalLM, Trainer, TrainerCallback  # noqa: E402

from offload import ConfigError  # noqa: E402
from offload.integrations.transformers import (OffloadTrainer, OffloadTrainerMixin, init_context,  # noqa: E402
                                               resolve_auto)
from tests.offload import hf_models as hf  # noqa: E402
from tests.offload import trainer_common as tc  # noqa: E402

REL = 1e-4


def _close(got: list[float], want: list[float], rel: float = REL, what: str = "loss") -> None:
    assert len(got) == len(want) and got, (what, got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), f"{what} at logged step {i + 1}: {g} vs the plain Trainer's {w}"


def _same_run(plain: Trainer, ours: Trainer, rel: float = REL) -> None:
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        _close(tc.logged(ours, key), tc.logged(plain, key), rel, key) if tc.logged(plain, key) else None


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# -- the config ----------------------------------------------------------------------------------


def test_auto_values_come_from_their_arguments(tmp_path):
    """Every "auto" transformers fills for DeepSpeed takes its own TrainingArguments value (each argument given a
    value no other has); a value set by hand that differs is an error naming it."""
    args = tc.args(str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=5, max_grad_norm=0.7,
                   learning_rate=2e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=3e-7, weight_decay=0.04,
                   warmup_steps=4, bf16=True)
    auto = "auto"
    config = {"train_micro_batch_size_per_gpu": auto, "train_batch_size": auto, "gradient_accumulation_steps": auto,
              "gradient_clipping": auto, "bf16": {"enabled": auto}, "fp16": {"enabled": auto},
              "optimizer": {"type": "AdamW", "params": {"lr": auto, "betas": auto, "eps": auto, "weight_decay": auto}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": auto, "warmup_max_lr": auto,
                                                                "warmup_num_steps": auto, "total_num_steps": auto}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": auto, "stage3_prefetch_bucket_size": auto,
                                    "stage3_param_persistence_threshold": auto}}
    out = resolve_auto(config, args, model=hf.build("llama"), num_training_steps=40)
    assert config["optimizer"]["params"]["eps"] == auto  # the caller's dict is left as it was
    batch = (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"])
    assert batch == (3, 5, 15)
    assert out["gradient_clipping"] == 0.7
    assert out["optimizer"]["params"] == {"lr": 2e-3, "betas": [0.8, 0.95], "eps": 3e-7, "weight_decay": 0.04}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 4,
                                          "total_num_steps": 40}
    assert out["bf16"] == {"enabled": True} and out["fp16"] == {"enabled": False}
    zero = out["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (32 * 32, int(0.9 * 32 * 32), 320)
    config["optimizer"]["params"]["eps"] = 1e-8
    with pytest.raises(ConfigError, match=r"optimizer.params.eps=1e-08 vs TrainingArguments adam_epsilon=3e-07"):
        resolve_auto(config, args)


# -- training against the plain Trainer ----------------------------------------------------------------


def test_stage2_cpu_matches_trainer(tmp_path):
    """Stage 2, optimizer state in host memory: the plain Trainer's losses, grad norms, learning rates and eval
    losses (evaluated every 2 steps during training); save_model's directory loads with from_pretrained and gives
    the trained model's logits."""
    run = dict(eval_n=8)
    kw = dict(eval_strategy="steps", eval_steps=2)
    plain = tc.train(Trainer, hf.build("gpt2"), tc.args(str(tmp_path / "plain"), **kw), **run)
    ours = tc.train(OffloadTrainer, hf.build("gpt2"), tc.args(str(tmp_path / "ours"), **kw),
                    offload_config=tc.offload_config(2, "cpu"), **run)
    assert len(tc.logged(ours, "eval_loss")) == 3
    _same_run(plain, ours)
    assert ours.offload_engine.zero_optimization_stage() == 2 and ours.offload_engine.global_steps == 6
    ours.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = tc.Repeated(4, seed=3).ids
    assert torch.equal(_logits(loaded, ids), _logits(ours.model_wrapped.eval(), ids))


def test_label_smoothing_matches_trainer(tmp_path):
    """label_smoothing_factor: the Trainer's label smoother, which shifts the labels for a causal LM (it reads
    the model's class through the wrapper)."""
    kw = dict(label_smoothing_factor=0.1, max_steps=3)
    plain = tc.train(Trainer, hf.build("gpt2"), tc.args(str(tmp_path / "plain"), **kw))
    ours = tc.train(OffloadTrainer, hf.build("gpt2"), tc.args(str(tmp_path / "ours"), **kw),
                    offload_config=tc.offload_config(2, "cpu"))
    _same_run(plain, ours)


def test_load_best_model_at_end(tmp_path):
    """load_best_model_at_end: the engine loads the best checkpoint's state; the model is then the one
    save_model wrote into that checkpoint."""
    kw = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
              metric_for_best_model="eval_loss", greater_is_better=True)  # "best": an early step's
    ours = tc.train(OffloadTrainer, hf.build("gpt2"), tc.args(str(tmp_path / "ours"), **kw), eval_n=8,
                    offload_config=tc.offload_config(2, "cpu"))
    best = ours.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-2"), best
    saved = dict(AutoModelForCausalLM.from_pretrained(best).named_parameters())
    for name, p in ours.model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def test_stage3_nvme_from_pretrained_matches_trainer(tmp_path):
    """Stage 3 with params and optimizer on NVMe (a tmp dir), the model from from_pretrained inside init_context
    (never whole): the plain Trainer's run from plain from_pretrained, evaluation during training included;
    save_model (gathered one unit at a time) loads back with the trained model's logits."""
    hf.build("llama", seed=5).save_pretrained(tmp_path / "src")
    config = tc.offload_config(3, "nvme", str(tmp_path))
    kw = dict(eval_strategy="steps", eval_steps=3)
    plain = tc.train(Trainer, AutoModelForCausalLM.from_pretrained(tmp_path / "src"),
                     tc.args(str(tmp_path / "plain"), **kw), eval_n=8)
    with init_context(config):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    assert all(p.is_meta for p in model.parameters())
    ours = tc.train(OffloadTrainer, model, tc.args(str(tmp_path / "ours"), **kw), offload_config=config, eval_n=8)
    engine = ours.offload_engine
    assert engine.stage3 is not None and engine.config.zero.offload_param.device.value == "nvme"
    assert engine.config.zero.offload_optimizer.device.value == "nvme"
    assert engine.config.zero.stage3_param_persistence_threshold == 320  # "auto": 10 * hidden_size
    _same_run(plain, ours)
    ours.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = tc.Repeated(4, seed=3).ids
    want = _logits(ours.model_wrapped.eval(), ids)
    assert torch.equal(_logits(loaded, ids), want)
    torch.testing.assert_close(want, _logits(plain.model.eval(), ids), rtol=1e-4, atol=1e-4)


def _ds_sections() -> dict:
    """The config's own optimizer and scheduler, every Trainer-owned value "auto"."""
    auto = "auto"
    return {"optimizer": {"type": "AdamW", "params": {"lr": auto, "betas": auto, "eps": auto, "weight_decay": auto}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": auto, "warmup_max_lr": auto,
                                                              "warmup_num_steps": auto, "total_num_steps": auto,
                                                              "warmup_type": "linear"}}}


def test_config_optimizer_and_scheduler_match_trainer(tmp_path):
    """A config with its own optimizer and scheduler (DeepSpeed's way: one group, every trainable param decayed;
    the engine steps the schedule): the plain Trainer handed the same torch AdamW and the same schedule as
    optimizers=(opt, sched). The logged lr is the one each step ran at, as the plain Trainer logs it."""
    from offload.config.schedulers import WarmupDecayLR

    model = hf.build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = WarmupDecayLR(opt, total_num_steps=6, warmup_min_lr=0.0, warmup_max_lr=3e-3, warmup_num_steps=2,
                          warmup_type="linear")
    plain = tc.train(Trainer, model, tc.args(str(tmp_path / "plain")), optimizers=(opt, sched))
    ours = tc.train(OffloadTrainer, hf.build("gpt2"), tc.args(str(tmp_path / "ours")),
                    offload_config=tc.offload_config(2, "cpu", **_ds_sections()))
    assert type(ours.offload_engine.lr_scheduler) is WarmupDecayLR
    assert len(ours.offload_engine.optimizer.param_groups) == 1
    _same_run(plain, ours)


def test_optimizer_and_scheduler_handed_to_the_trainer(tmp_path):
    """optimizers=(AdamW, cosine schedule with warm-up) handed to the Trainer: the engine runs that AdamW's groups
    and hyperparameters, and the schedule, stepped by the Trainer, sets the engine's lr."""
    from transformers import get_cosine_schedule_with_warmup

    def handed(model):
        opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if "ln" not in n]},
                                 {"params": [p for n, p in model.named_parameters() if "ln" in n], "weight_decay": 0}],
                                lr=2e-3, weight_decay=0.05, eps=1e-6)
        return opt, get_cosine_schedule_with_warmup(opt, 2, 6)

    model = hf.build("gpt2")
    plain = tc.train(Trainer, model, tc.args(str(tmp_path / "plain")), optimizers=handed(model))
    model = hf.build("gpt2")
    ours = tc.train(OffloadTrainer, model, tc.args(str(tmp_path / "ours")), optimizers=handed(model),
                    offload_config=tc.offload_config(2, "cpu"))
    groups = ours.offload_engine.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.05, 0] and groups[0]["eps"] == 1e-6
    _same_run(plain, ours)


def test_gradient_accumulation_matches_trainer(tmp_path):
    """gradient_accumulation_steps=2 over 5 micro-batches an epoch (the last cycle one micro-batch): the Trainer
    divides the loss itself, the engine does not divide again, and steps where the Trainer syncs."""
    kw = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=6)
    plain = tc.train(Trainer, hf.build("gpt2"), tc.args(str(tmp_path / "plain"), **kw), train_n=10)
    ours = tc.train(OffloadTrainer, hf.build("gpt2"), tc.args(str(tmp_path / "ours"), **kw), train_n=10,
                    offload_config=tc.offload_config(2, "cpu"))
    assert ours.offload_engine.gradient_accumulation_steps() == 2
    assert ours.offload_engine.global_steps == 6  # 2 epochs of 2+2+1 micro-batches
    _same_run(plain, ours)


def test_gradient_checkpointing_matches_trainer(tmp_path):
    """gradient_checkpointing=True, at stage 2 and at stage 3 (optimizer and params in host memory)."""
    kw = dict(gradient_checkpointing=True, max_steps=4)
    plain = tc.train(Trainer, hf.build("llama"), tc.args(str(tmp_path / "plain"), **kw))
    for stage in (2, 3):
        config = tc.offload_config(stage, "cpu")
        if stage == 3:
            torch.manual_seed(0)
            with init_context(config):
                model = hf.BUILDERS["llama"][0](hf.llama_config())
        else:
            model = hf.build("llama")
        ours = tc.train(OffloadTrainer, model, tc.args(str(tmp_path / f"ours{stage}"), **kw), offload_config=config)
        assert ours.model.is_gradient_checkpointing
        _same_run(plain, ours)


def test_bf16(tmp_path):
    """bf16=True fills bf16.enabled: the engine computes in bf16 with fp32 masters (DeepSpeed's bf16, not the
    plain Trainer's autocast), within 2^-5 of the plain Trainer's bf16 losses."""
    plain = tc.train(Trainer, hf.build("gpt2"), tc.args(str(tmp_path / "plain"), bf16=True, max_steps=4))
    ours = tc.train(OffloadTrainer, hf.build("gpt2"), tc.args(str(tmp_path / "ours"), bf16=True, max_steps=4),
                    offload_config=tc.offload_config(2, "cpu"))
    assert ours.offload_engine.bfloat16_enabled() and next(ours.model.parameters()).dtype == torch.bfloat16
    _close(tc.logged(ours, "loss"), tc.logged(plain, "loss"), rel=2 ** -5)


def test_fp16_skipped_steps_do_not_advance_the_schedule(tmp_path):
    """fp16=True fills fp16.enabled: the engine scales the loss (Accelerate's GradScaler is off) and skips a step
    whose gradient overflows; the Trainer's schedule then holds, as it does for DeepSpeed's skipped steps."""
    config = tc.offload_config(2, "cpu", fp16={"enabled": "auto", "initial_scale_power": 16, "loss_scale_window": 2})
    ours = tc.train(OffloadTrainer, hf.build("gpt2"), tc.args(str(tmp_path), fp16=True, max_steps=10),
                    offload_config=config)
    engine = ours.offload_engine
    assert engine.fp16_enabled() and engine.skipped_steps >= 1 and ours.accelerator.scaler is None
    lrs = tc.logged(ours, "learning_rate")  # linear warm-up then decay: no two steps alike unless one was skipped
    assert len(lrs) == 10 and sum(a == b for a, b in zip(lrs, lrs[1:])) == engine.skipped_steps
    assert tc.logged(ours, "loss")[-1] < tc.logged(ours, "loss")[0]


# -- checkpoints -------------------------------------------------------------------------------------


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def _params(trainer) -> dict[str, torch.Tensor]:
    engine = trainer.offload_engine
    held = engine.stage3.coordinator.gathered() if engine.stage3 is not None else contextlib.nullcontext()
    with held:
        return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


@pytest.mark.parametrize("stage,device,schedule", [(2, "cpu", "trainer"), (3, "nvme", "config")])
def test_resume_ends_where_the_uninterrupted_run_does(tmp_path, stage, device, schedule):
    """8 steps (a schedule with warm-up, dropout on) against 4 steps, a save, a fresh start (new model, new
    trainer) and resume_from_checkpoint to 8: the same parameters bit for bit, the same losses and learning
    rates after the resume. The data position is mid-epoch (6 steps an epoch). Stage 2 with the Trainer's
    schedule (its state in scheduler.pt); stage 3 on NVMe with the config's (its state in the engine's)."""
    def model():
        torch.manual_seed(0)
        return hf.BUILDERS["gpt2"][0](hf.gpt2_config().__class__(**{**hf.gpt2_config().to_dict(),
                                                                   "resid_pdrop": 0.1, "embd_pdrop": 0.1}))
    config = tc.offload_config(stage, device, str(tmp_path), **(_ds_sections() if schedule == "config" else {}))
    kw = dict(max_steps=8, save_strategy="steps", save_steps=4, warmup_steps=3)
    whole = tc.train(OffloadTrainer, model(), tc.args(str(tmp_path / "whole"), **kw), offload_config=config)
    first = OffloadTrainer(model=model(), args=tc.args(str(tmp_path / "cut"), **kw), train_dataset=tc.Repeated(24),
                           offload_config=config, callbacks=[_StopAt(4)])
    first.train()
    assert first.state.global_step == 4 and os.path.isdir(tmp_path / "cut" / "checkpoint-4" / "global_step4")
    first.offload_engine.close()
    resumed = OffloadTrainer(model=model(), args=tc.args(str(tmp_path / "cut"), **kw), train_dataset=tc.Repeated(24),
                             offload_config=config)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-4"))
    assert resumed.state.global_step == 8
    want, got = _params(whole), _params(resumed)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert tc.logged(resumed, "loss")[-4:] == tc.logged(whole, "loss")[-4:]
    assert tc.logged(resumed, "learning_rate")[-4:] == tc.logged(whole, "learning_rate")[-4:]


# -- TRL and ranks -------------------------------------------------------------------------------------


def _tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(hf.VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t0", unk_token="t1")


def test_sft_trainer_through_the_mixin(tmp_path):
    """class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer): the plain SFTTrainer's losses, grad norms and
    token accuracies on the same pre-tokenized data (fp32; SFTConfig's own gradient checkpointing on)."""
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install .[test])")
    datasets = pytest.importorskip("datasets")

    class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer):
        pass

    data = datasets.Dataset.from_dict({"input_ids": [ids.tolist() for ids in tc.Repeated(24).ids]})

    def run(cls, out, **kw):
        args = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=5, learning_rate=3e-3,
                             weight_decay=0.01, warmup_steps=2, logging_steps=1, report_to=[], save_strategy="no",
                             seed=0, data_seed=0, disable_tqdm=True, use_cpu=True, max_length=hf.SEQ,
                             dataloader_num_workers=0, bf16=False)  # SFTConfig's default is bf16
        trainer = cls(model=hf.build("llama"), args=args, train_dataset=data, processing_class=_tokenizer(), **kw)
        trainer.train()
        return trainer

    plain = run(trl.SFTTrainer, tmp_path / "plain")
    ours = run(OffloadSFTTrainer, tmp_path / "ours", offload_config=tc.offload_config(2, "cpu"))
    assert ours.offload_engine is not None
    _same_run(plain, ours)
    _close(tc.logged(ours, "mean_token_accuracy"), tc.logged(plain, "mean_token_accuracy"), what="accuracy")


def test_two_ranks_under_torchrun_match_the_plain_trainer(tmp_path):
    """2 ranks (gloo, CPU): the plain Trainer's DDP run and OffloadTrainer at stage 2 log the same losses, grad
    norms and eval losses; from_pretrained of save_model's directory gives the trained model's logits."""
    from tests import child_pythonpath

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=child_pythonpath(root), OMP_NUM_THREADS="1")
    logs = {}
    for mode in ("plain", "offload"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                               os.path.join(root, "tests", "offload", "trainer_worker.py"), mode, str(tmp_path / mode)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        logs[mode] = json.loads((tmp_path / mode / "log.json").read_text())
    for key in ("loss", "grad_norm", "eval_loss"):
        want = [h[key] for h in logs["plain"] if key in h]
        _close([h[key] for h in logs["offload"] if key in h], want, what=key)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "offload" / "saved")
    want = torch.load(tmp_path / "offload" / "logits.pt")
    assert torch.equal(_logits(loaded, tc.Repeated(4, seed=3).ids), want)
