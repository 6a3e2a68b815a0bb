"""Inventory: the ops of one training step that force a device-to-host copy (issue 21).

Runs one warm-up step and one recorded step of every (task, method) on tiny data with
``APG_NATIVE_KERNELS=0`` (the PyTorch code GPU trials run), under a dispatch mode that
records ``_local_scalar_dense`` (``.item()``, ``bool(tensor)``, ``float(tensor)``),
``nonzero`` and the other ops whose output shape depends on the data, with the library
line that called each. On a GPU every one of them is a host synchronization.

    APG_MNIST_DIR=... python bench/host_syncs.py [--tasks gmm dgmm bmnist] [--methods apg rws-mlp]

Some sites run only on CPU (``apg/random.py``'s key derivation and its Gamma rejection
loop: on CUDA ``uniform`` and ``standard_gamma`` call ``torch.rand`` and
``torch._standard_gamma``), so the printout over-counts what a GPU step would sync on.
"""

from __future__ import annotations

import argparse
import collections
import os
import traceback

os.environ["APG_NATIVE_KERNELS"] = "0"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique2",
    "repeat_interleave",
    "equal",
    "is_nonzero",
}
SIZES = {
    "gmm": {"num_points": 60},
    "dgmm": {"num_points": 200, "radius": 2.0},
    "bmnist": {"num_frames": 3, "num_digits": 1, "split": "train"},
}


class SyncRecorder(TorchDispatchMode):
    """Counts sync-forcing ops by (op, the innermost apg/ or pipeline/ frame that called it)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            frames = [
                f for f in traceback.extract_stack() if "/apg/" in f.filename or "/pipeline/" in f.filename
            ]
            where = "?"
            if frames:
                f = frames[-1]
                where = f"{f.filename[f.filename.rindex('/apg/') + 1 if '/apg/' in f.filename else f.filename.rindex('/pipeline/') + 1 :]}:{f.lineno} {f.name}"
            self.hits[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def inventory(task: str, method: str) -> collections.Counter:
    from apg.tasks.simulation import simulate_set
    from apg.training import TrainConfig, Trainer

    x = torch.from_numpy(simulate_set(task, {}, 4, 0, SIZES[task])["x"])
    network = {"num_digits": 1} if task == "bmnist" else {}
    cfg = TrainConfig(
        task=task,
        method=method,
        sweeps=3,
        particles=4,
        batch_size=2,
        iterations=2,
        network=network,
        lr=1e-4,
    )
    torch.manual_seed(0)
    trainer = Trainer(cfg.validate(), x)
    trainer.step()
    recorder = SyncRecorder()
    with recorder:
        trainer.step()
    return recorder.hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="*", default=["gmm", "dgmm", "bmnist"])
    parser.add_argument("--methods", nargs="*", default=["apg", "rws-mlp"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| task | method | syncs per step | op | where |\n| --- | --- | ---: | --- | --- |")
    for task in args.tasks:
        for method in args.methods:
            for (op, where), count in sorted(inventory(task, method).items(), key=lambda kv: -kv[1]):
                print(f"| {task} | {method} | {count} | `{op}` | `{where}` |", flush=True)


if __name__ == "__main__":
    main()
