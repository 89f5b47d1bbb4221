"""Saves onto a small file system until it is full (run as a script in a mount namespace; not collected).

usage: full_disk_worker.py DIR  (DIR: a file system with room for one checkpoint of this model, not two)
Prints one JSON line: what the second save raised, and what DIR holds after it.
"""
import json
import os
import sys

import torch

from tests.offload import ckpt_worker
from offload.builder import initialize


def main() -> None:
    save_dir = sys.argv[1]
    engine, _, _, _ = initialize(model=ckpt_worker.model(), config=ckpt_worker.config("cpu", save_dir, 2))
    engine.save_checkpoint(save_dir, tag="first")
    out = {"raised": None}
    try:
        engine.save_checkpoint(save_dir, tag="second")
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.update(raised=type(err).__name__, errno=getattr(err, "errno", None), message=str(err),
                   offload_error=isinstance(err, __import__("offload").OffloadError))
    out["entries"] = sorted(os.listdir(save_dir))
    with open(os.path.join(save_dir, "latest")) as f:
        out["latest"] = f.read()
    engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
