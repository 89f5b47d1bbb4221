"""Peak resident growth while ``initialize`` reads a checkpoint into the shards (run by a test; not collected).

usage: hf_load_worker.py CKPT_DIR WORKDIR [from_config|from_pretrained]
Builds the Llama whose config.json is in CKPT_DIR under init_context (stage 3, params and optimizer on NVMe
in WORKDIR) with from_config + load_pretrained(CKPT_DIR) (the default) or from_pretrained(CKPT_DIR) inside the
context, initializes, with stage 3's read into the shards wrapped: VmHWM is
reset as it starts and read as it ends. Prints JSON: the growth of the peak over the resident set at its
start, in bytes.
"""
import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from offload import init_context, initialize, load_pretrained
from offload.runtime.host_heap import peak_resident_bytes, reset_peak_resident
from offload.zero import stage3


def main() -> None:
    ckpt, workdir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": workdir},
                                    "offload_param": {"device": "nvme", "nvme_path": workdir}}}
    if len(sys.argv) > 3 and sys.argv[3] == "from_pretrained":
        with init_context(config):
            net, info = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True, output_loading_info=True)
        assert not info["missing_keys"] and all(p.is_meta for p in net.parameters())
    else:
        with init_context(config):
            net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt, local_files_only=True))
        assert load_pretrained(net, ckpt).missing_keys == ()
    growth = []
    read = stage3.load_into_shards

    def measured(*args, **kwargs):
        before = reset_peak_resident()
        out = read(*args, **kwargs)
        growth.append(peak_resident_bytes() - before)
        return out

    stage3.load_into_shards = measured
    engine, _, _, _ = initialize(model=net, config=config)
    print(json.dumps({"growth": growth}))
    engine.close()


if __name__ == "__main__":
    main()
