"""A Llama-shaped model through the engine as Hugging Face users bring it: saved as sharded bf16 safetensors,
built under init_context, loaded into stage 3 with params and optimizer on NVMe, trained 2 steps, saved back;
the saved directory loaded by transformers alone. Each phase in its own process, in the same run.

    .venv/bin/python tools/bench/bench_hf_load.py [--layers 8] [--hidden 1024] [--intermediate 2816]
        [--vocab 32000] [--heads 8] [--kv-heads 4] [--shard-mib 256] [--tokens 64] [--rounds 3]
        [--build from_pretrained|from_config] [--no-peer] [--keep] [--workdir DIR] [--out FILE]

The checkpoint is written tensor by tensor (the model built on the meta device for its names and shapes;
each tensor drawn, cast to bf16 and handed to the engine's sharded writer, which holds at most one file), so
the bench never holds the model whole either. ``--build from_pretrained`` (the default) loads it with
``AutoModelForCausalLM.from_pretrained`` inside ``init_context``; ``from_config`` with ``from_config`` +
``load_pretrained``. ``--no-peer`` leaves out the peer's load of the source (it holds the whole model once
used); the logits of the saved directory are still compared. The work directory is removed at the end
unless ``--keep``.

(``--layers 22 --hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4`` is TinyLlama's ~1.1B shape;
``--layers 26 --hidden 2560 --intermediate 6912 --heads 20 --kv-heads 4`` ~2B. ``--host-gib`` sets
``offload.host_memory_bytes``: unset, the optimizer state's NVMe window takes up to half the memory available
when the engine starts, which at these sizes holds most of the state in host memory anyway.)

Reported, with VmHWM reset at each measure's start: the engine's peak RSS growth while it reads the checkpoint
into its shards, its RSS before initialize and after it (the heap trimmed: the engine's resident state), the
peer's (``AutoModelForCausalLM.from_pretrained`` of the same directory, which maps the files: their pages
count only once touched) peak RSS growth after loading and after one forward, the ratio ours / peer, the
seconds of each phase, and the largest logit difference between the engine's model and ``from_pretrained``
of what it saved.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
MIB = 1 << 20

from offload.runtime.host_heap import peak_resident_bytes, reset_peak_resident, resident_bytes  # noqa: E402


def _model_config(a):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                       max_position_embeddings=256, tie_word_embeddings=False, dtype="bfloat16")


def _batch(a):
    import torch

    return torch.randint(0, a.vocab, (1, a.tokens), generator=torch.Generator().manual_seed(0))


def phase_save(a) -> dict:
    """The checkpoint, one tensor at a time: weights N(0, 0.02), norms 1, in bf16 (``hf_checkpoint``)."""
    from hf_checkpoint import write_random_checkpoint

    before = reset_peak_resident()
    out = write_random_checkpoint(_model_config(a), os.path.join(a.workdir, "src"),
                                  max_shard_size_bytes=a.shard_mib * MIB)
    return {"params": out["params"], "save_s": out["seconds"], "save_peak_growth": peak_resident_bytes() - before,
            "save_held": out["writer_peak_bytes"]}


def phase_engine(a) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from offload import init_context, initialize, load_pretrained
    from offload.runtime.host_heap import release_free_heap
    from offload.zero import stage3

    torch.set_num_threads(os.cpu_count() or 1)
    src = os.path.join(a.workdir, "src")
    nvme = {"device": "nvme", "nvme_path": a.workdir}
    config = {"train_batch_size": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": dict(nvme)}}
    if a.host_gib:  # else the optimizer state's window takes up to half the memory available at start
        config["offload"] = {"host_memory_bytes": int(a.host_gib * (1 << 30))}
    with init_context(config):
        if a.build == "from_pretrained":
            model, info = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, output_loading_info=True)
            missing = len(info["missing_keys"])
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src, local_files_only=True))
    if a.build != "from_pretrained":
        missing = len(load_pretrained(model, src).missing_keys)
    model.train()
    read = stage3.load_into_shards
    out: dict = {"missing_keys": missing}

    def measured(*args, **kwargs):
        out["init_peak_before_read"] = peak_resident_bytes()
        before = reset_peak_resident()
        t = time.perf_counter()
        result = read(*args, **kwargs)
        out.update(read_s=time.perf_counter() - t, read_peak_growth=peak_resident_bytes() - before,
                   read_rss_before=before, read_peak=peak_resident_bytes(), read_load=os.getloadavg()[0])
        return result

    stage3.load_into_shards = measured
    before = reset_peak_resident()
    t0 = time.perf_counter()
    engine, _, _, _ = initialize(model=model, config=config)
    out["init_s"] = time.perf_counter() - t0
    release_free_heap()
    reset_peak_resident()
    out.update(init_rss_before=before, resident_after_init=resident_bytes())
    ids = _batch(a)
    t0 = time.perf_counter()
    losses = []
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    release_free_heap()
    out.update(train_s=time.perf_counter() - t0, losses=losses, train_peak=peak_resident_bytes(),
               resident_after_train=resident_bytes(), train_load=os.getloadavg()[0])
    t0 = time.perf_counter()
    engine.save_16bit_model(os.path.join(a.workdir, "out"), max_shard_size_bytes=a.shard_mib * MIB)
    out["save_s"] = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        torch.save(engine(input_ids=ids).logits.float(), os.path.join(a.workdir, "engine_logits.pt"))
    engine.close()
    return out


def phase_peer(a) -> dict:
    """transformers alone: from_pretrained of the source (the peer's load), then of what the engine saved."""
    import torch
    from transformers import AutoModelForCausalLM

    from transformers.models.llama import modeling_llama  # noqa: F401  (its import is not the load)

    torch.set_num_threads(os.cpu_count() or 1)
    out: dict = {}
    if a.peer:
        before = reset_peak_resident()
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(os.path.join(a.workdir, "src"), dtype=torch.bfloat16).eval()
        out.update(peer_load_s=time.perf_counter() - t0, peer_peak_growth=peak_resident_bytes() - before)
        with torch.no_grad():  # the mapped file's pages count once touched: one forward touches every weight
            model(input_ids=_batch(a))
        out["peer_peak_growth_used"] = peak_resident_bytes() - before
        del model
    saved = AutoModelForCausalLM.from_pretrained(os.path.join(a.workdir, "out"), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = saved(input_ids=_batch(a)).logits.float()
    want = torch.load(os.path.join(a.workdir, "engine_logits.pt"))
    out["logit_max_abs_diff"] = (logits - want).abs().max().item()
    out["logit_max_abs"] = want.abs().max().item()
    return out


def _run(phase: str, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, __file__, "--phase", phase, *argv], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 8), ("hidden", 1024), ("intermediate", 2816), ("vocab", 32000), ("heads", 8),
                          ("kv-heads", 4), ("shard-mib", 256), ("tokens", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--build", choices=("from_pretrained", "from_config"), default="from_pretrained")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="leave out the peer's load of the source")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--host-gib", type=float, default=0.0,
                   help="offload.host_memory_bytes in GiB (0: unset, the engine sizes it from the memory available)")
    p.add_argument("--rounds", type=int, default=3, help="engine and peer runs (medians reported)")
    p.add_argument("--workdir", default="/tmp/ofl-bench-hf")
    p.add_argument("--out", help="append the markdown result here")
    p.add_argument("--phase", choices=("save", "engine", "peer"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:
        print(json.dumps({"save": phase_save, "engine": phase_engine, "peer": phase_peer}[a.phase](a)))
        return
    os.makedirs(a.workdir, exist_ok=True)
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable"))
    print(f"memory available at the start: {available / (1 << 30):.1f} GiB; load {os.getloadavg()[0]:.2f}", flush=True)
    argv = list(sys.argv[1:])
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i:i + 2]
    argv = [arg for arg in argv if not arg.startswith("--out=")]
    saved = _run("save", argv)
    try:
        runs = [{**_run("engine", argv), **_run("peer", argv)} for _ in range(a.rounds)]
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)
    r = {**saved, **{k: statistics.median(run[k] for run in runs) if isinstance(runs[0][k], (int, float)) else
                     runs[0][k] for k in runs[0]}}
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    peer = (f"{r['peer_peak_growth'] / MIB:.0f} / {r['peer_peak_growth_used'] / MIB:.0f} MiB" if a.peer else
            "not run (--no-peer)")
    ratio = f"{r['read_peak_growth'] / max(1, r['peer_peak_growth_used']):.3f}" if a.peer else "-"
    lines = [
        f"### Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.intermediate}, vocab {a.vocab}: "
        f"{r['params'] / 1e6:.0f}M parameters, bf16 safetensors in {a.shard_mib} MiB files, built by {a.build}; "
        f"medians of {a.rounds} round(s); offload.host_memory_bytes "
        f"{f'{a.host_gib:g} GiB' if a.host_gib else 'unset'} (load average at the end {load})",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| checkpoint written tensor by tensor: peak RSS growth / most bytes the writer held | "
        f"{r['save_peak_growth'] / MIB:.0f} / {r['save_held'] / MIB:.0f} MiB |",
        f"| engine: RSS as the read into the shards starts (its resident state then) / peak during the read | "
        f"{r['read_rss_before'] / MIB:.0f} / {r['read_peak'] / MIB:.0f} MiB (load {r['read_load']:.2f}) |",
        f"| engine: peak RSS growth while reading the checkpoint into the shards | {r['read_peak_growth'] / MIB:.1f} MiB |",
        f"| engine: RSS before initialize / peak of initialize before the read / resident after it (heap trimmed) | "
        f"{r['init_rss_before'] / MIB:.0f} / {r['init_peak_before_read'] / MIB:.0f} / "
        f"{r['resident_after_init'] / MIB:.0f} MiB |",
        f"| engine: peak RSS over the 2 steps / resident after them (heap trimmed) | {r['train_peak'] / MIB:.0f} / "
        f"{r['resident_after_train'] / MIB:.0f} MiB (load {r['train_load']:.2f}) |",
        f"| peer (from_pretrained, files mapped): peak RSS growth of its load / after one forward | {peer} |",
        f"| ours (read) / peer (after one forward), peak growth | {ratio} |",
        f"| seconds: read / initialize / 2 steps / save back / peer load | {r['read_s']:.1f} / {r['init_s']:.1f} / "
        f"{r['train_s']:.1f} / {r['save_s']:.1f} / {r.get('peer_load_s', float('nan')):.1f} |",
        f"| losses of the 2 steps ({a.tokens} tokens) | {r['losses'][0]:.4f}, {r['losses'][1]:.4f} |",
        f"| logits: from_pretrained(saved) vs the engine's model, max abs diff / max abs | "
        f"{r['logit_max_abs_diff']:.4g} / {r['logit_max_abs']:.4g} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
