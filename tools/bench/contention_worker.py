"""One contender of bench_contention.py: trains the ~98M GPT for a few steps and prints its times as JSON.

Run by the driver, never by hand: each (contender, config) is a fresh process, so one contender's
threads, heap and JIT state never reach the next one's. It runs in whichever interpreter the driver
picks: ours and plain torch in the project's .venv, DeepSpeed in its own virtual environment (which
has no project installed, so the model module is loaded from its file, with the repo root on the path
for ``csrc.errors``). Under torchrun (config e) every rank runs this; rank 0 prints.

Per step: forward (the loss), backward (with whatever gradient reduction and offload the contender
does there), step (clipping, the optimizer, params written back) in seconds, the loss, and the
process's bytes read from storage (``/proc/self/io`` read_bytes) during the step.

Usage (the driver's): contention_worker.py CONTENDER CONFIG --steps N --nvme-path DIR [--json-out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = {"vocab": 16384, "seq": 128, "dim": 768, "layers": 12, "heads": 12, "batch": 4}
LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0
CONFIGS = {  # name: (stage, offload_param device, offload_optimizer device, ranks)
    "a": (2, None, "cpu", 1), "b": (2, None, "nvme", 1), "c": (3, "cpu", "cpu", 1), "d": (3, "nvme", "nvme", 1),
    "e": (2, None, "cpu", 2),
}


def _gpt_module():
    spec = importlib.util.spec_from_file_location("_bench_gpt", ROOT / "offload" / "models" / "gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def build_model() -> torch.nn.Module:
    gpt = _gpt_module()
    return gpt.GPT(gpt.GPTConfig(vocab_size=MODEL["vocab"], block_size=MODEL["seq"], n_layer=MODEL["layers"],
                                 n_head=MODEL["heads"], n_embd=MODEL["dim"], tied_head=True), seed=0)


def batches(rank: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1 + rank)
    return [torch.randint(0, MODEL["vocab"], (MODEL["batch"], MODEL["seq"] + 1), generator=gen) for _ in range(count)]


def ds_config(config: str, nvme_path: str) -> dict:
    """DeepSpeed's JSON config for one of CONFIGS; our engine reads the same keys."""
    stage, param, opt, _ = CONFIGS[config]

    def where(device: str) -> dict:
        return {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}

    zero = {"stage": stage, "offload_optimizer": where(opt)}
    if param:
        zero["offload_param"] = where(param)
    return {"train_micro_batch_size_per_gpu": MODEL["batch"], "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": zero}


def _read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


class _Torch:
    """Plain torch: AdamW (fused where this torch has it on CPU), clip_grad_norm_; DDP at 2 ranks."""

    def __init__(self, model: torch.nn.Module, world: int) -> None:
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def forward(self, idx, tgt):
        return self.model(idx, tgt)

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _Engine:
    """Ours or DeepSpeed's engine: engine(idx, tgt), engine.backward(loss), engine.step()."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def forward(self, idx, tgt):
        return self.engine(idx, tgt)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()


def make(contender: str, config: str, nvme_path: str, world: int):
    model = build_model()
    if contender == "torch":
        if world > 1:
            import torch.distributed as dist
            dist.init_process_group("gloo")
        return _Torch(model, world)
    cfg = ds_config(config, nvme_path)
    if contender == "ours":
        from offload.builder import initialize
        engine, _, _, _ = initialize(model=model, config=cfg)
        return _Engine(engine)
    import deepspeed  # the DeepSpeed venv's
    if "RANK" not in os.environ:  # one process: DeepSpeed would otherwise look for MPI
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return _Engine(engine)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("contender", choices=("ours", "deepspeed", "torch"))
    ap.add_argument("config", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--nvme-path", required=True)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.perf_counter()
    runner = make(args.contender, args.config, args.nvme_path, world)
    setup_s = time.perf_counter() - t0
    data = batches(rank, args.steps)
    rows = []
    for s in range(args.steps):
        idx, tgt = data[s][:, :-1], data[s][:, 1:]
        r0 = _read_bytes()
        t0 = time.perf_counter()
        loss = runner.forward(idx, tgt)
        t1 = time.perf_counter()
        r1 = _read_bytes()
        runner.backward(loss)
        t2 = time.perf_counter()
        r2 = _read_bytes()
        runner.step()
        t3 = time.perf_counter()
        r3 = _read_bytes()
        rows.append({"fwd": t1 - t0, "bwd": t2 - t1, "step": t3 - t2, "loss": float(loss.item()),
                     "read_bytes": r3 - r0, "read_fwd": r1 - r0, "read_bwd": r2 - r1, "read_step": r3 - r2})
    if world > 1:  # a step's time is the slowest rank's
        import torch.distributed as dist
        t = torch.tensor([[r["fwd"], r["bwd"], r["step"]] for r in rows], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for r, (f, b, st) in zip(rows, t.tolist()):
            r.update(fwd=f, bwd=b, step=st)
    out = {"contender": args.contender, "config": args.config, "world": world, "setup_s": setup_s,
           "torch_threads": torch.get_num_threads(), "rows": rows,
           "max_rss_mib": _max_rss_mib()}
    if rank == 0:
        text = json.dumps(out)
        if args.json_out:
            Path(args.json_out).write_text(text)
        print("RESULT " + text, flush=True)
    return 0


def _max_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # skip interpreter teardown: gloo's and DeepSpeed's threads can hang it
