"""A script that trains and ends as a user's does: without engine.close() (not collected by pytest).

usage: exit_worker.py DEVICE WORKDIR STEPS END
END: "normal" (falls off the end), "raise" (an exception nobody catches, after the last step), "kill" (SIGKILL
after the last step), "hold" (prints "held" and waits for a signal: another process's swap files are live).
With OFFLOAD_DAEMON_SOCKET set the state goes to that daemon (job "exit-test"). Appends the step it started
at (the step it resumed at, or 0) to WORKDIR/started.txt, and prints the swap directory of its engine.
"""
import os
import signal
import sys
import time

import torch

from offload import initialize
from tests.offload import ckpt_worker


def main() -> None:
    device, workdir, steps, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    config = ckpt_worker.config(device, workdir, stage=2)
    if os.environ.get("OFFLOAD_DAEMON_SOCKET"):
        config["offload"] = {"job_id": "exit-test"}
    engine, _, _, _ = initialize(model=ckpt_worker.model(), config=config)
    start = engine.global_steps
    with open(os.path.join(workdir, "started.txt"), "a") as f:
        f.write(f"{start}\n")
    if engine.tier is not None and engine.tier.swap_dir is not None:
        print("swap", engine.tier.swap_dir.path, flush=True)
    for x, y in ckpt_worker.batches(start + steps)[start:]:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    if end == "raise":
        raise RuntimeError("the script failed after its last step")
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if end == "hold":
        print("held", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
