"""How far the numbers behind a numerics fingerprint move when only the arithmetic changes.

For every distinct training config of a params file's (or a profile's) grids (``apg.fingerprint.shrunk``), the
fingerprinted numbers are computed under several arithmetic variants of the same code, each
in its own process, and compared with the default build's:

- ``torch-twins``: ``APG_NATIVE_KERNELS=0``, every native kernel replaced by its PyTorch twin
  (other loops, other summation orders, no ``-ffast-math``);
- ``portable-build``: the native kernels built with ``-O2`` only (no ``-march=native``, no
  ``-ffast-math``): what a CPU without this machine's vector units would compute;
- ``omp-1``: ``OMP_NUM_THREADS=1``: the native kernels' own threads cut to one.

Prints, per variant, the largest difference of any number, the count above each
rounding tolerance, whether each config's fingerprint agrees with the default's, and the
time a fingerprint takes. ``apg.fingerprint.DIGITS`` rests on this table.

    python bench/fingerprint_stability.py --params params.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "default": {},
    "torch-twins": {"APG_NATIVE_KERNELS": "0"},
    "portable-build": {"APG_BENCH_PORTABLE_BUILD": "1"},
    "omp-1": {"OMP_NUM_THREADS": "1"},
}


def difference(u: float, v: float) -> float:
    return abs(u - v) / max(abs(u), abs(v), 1e-30)


def configs(params_file: str) -> list[tuple[str, dict]]:
    """``(task, shrunk TrainConfig as a dict)`` for every distinct config of the grids."""
    from apg.fingerprint import shrunk
    from pipeline.config.params import grid_cells
    from pipeline.config.profiles import load

    params = load(params_file)
    seen: dict[str, tuple[str, dict]] = {}
    for task in params["tasks"]:
        for cell in grid_cells(params, task):
            cfg = shrunk(cell.train).to_dict()
            seen.setdefault(json.dumps(cfg, sort_keys=True), (task, cfg))
    return list(seen.values())


def measure(params_file: str, out: str) -> None:
    """In this process: every config's numbers and seconds, to ``out`` (JSON)."""
    if os.environ.get("APG_BENCH_PORTABLE_BUILD") == "1":
        import apg.kernels

        apg.kernels._COMPILE_FLAGS[:] = ["-O2", "-fopenmp", "-fPIC"]
    import time

    import torch

    from apg.fingerprint import BATCH, numbers
    from apg.tasks.simulation import simulate_set
    from apg.training import TrainConfig
    from pipeline.config.profiles import load

    params = load(params_file)
    rows = []
    for task, cfg in configs(params_file):
        section = params[task]
        x = simulate_set(task, section["model"], BATCH, 0, section["data"]["train"]["sizes"])["x"]
        start = time.perf_counter()
        got = numbers(TrainConfig.from_dict(cfg), torch.from_numpy(x).float())
        rows.append({"task": task, "cfg": cfg, "numbers": got, "seconds": time.perf_counter() - start})
    Path(out).write_text(json.dumps(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="a params file or a profile's name (smoke)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child process's output file
    args = parser.parse_args()
    if args.measure:
        measure(args.params, args.measure)
        return 0
    from apg.fingerprint import rounded

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in VARIANTS.items():
            out = Path(tmp) / f"{name}.json"
            child_env = {**os.environ, **env, "APG_KERNEL_CACHE": str(Path(tmp) / f"kernels-{name}")}
            subprocess.run(
                [sys.executable, __file__, "--params", args.params, "--measure", str(out)],
                env=child_env,
                check=True,
            )
            results[name] = json.loads(out.read_text())
    base = results["default"]
    seconds = sorted(r["seconds"] for r in base)
    print(
        f"{len(base)} configs; seconds per fingerprint: median {seconds[len(seconds) // 2]:.2f}, max {seconds[-1]:.2f}"
    )
    digits = (3, 4, 5, 6, 7)
    print(
        "| variant | numbers | largest relative difference | configs whose fingerprint agrees at "
        + " / ".join(f"{d}" for d in digits)
        + " digits |"
    )
    print("| --- | ---: | ---: | --- |")
    for name, rows in results.items():
        if name == "default":
            continue
        pairs = [list(zip(b["numbers"], r["numbers"], strict=True)) for b, r in zip(base, rows, strict=True)]
        diffs = [difference(u, v) for config in pairs for (_, u), (_, v) in config]
        agree = [
            sum(all(rounded(u, d) == rounded(v, d) for (_, u), (_, v) in config) for config in pairs)
            for d in digits
        ]
        print(
            f"| {name} | {len(diffs)} | {max(diffs):.1e} | "
            + " / ".join(str(a) for a in agree)
            + f" of {len(rows)} |"
        )
        for b, config in zip(base, pairs, strict=True):
            rel, key = max((difference(u, v), key) for (key, u), (_, v) in config)
            print(
                f"    {b['task']:6s} {b['cfg']['method']:16s} K{b['cfg']['sweeps']} L{b['cfg']['particles']}: "
                f"max {rel:.1e} at {key}; {b['seconds']:.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
