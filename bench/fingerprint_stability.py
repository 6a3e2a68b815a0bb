"""How far the numbers behind a numerics fingerprint move when only the arithmetic changes.

For every distinct training config of a params file's grids (``apg.fingerprint.shrunk``), the
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


def difference(key: str, u: float, v: float) -> float:
    """Relative difference; absolute for a gradient fraction (rounded to decimal places)."""
    if "/grad_fraction/" in key:
        return abs(u - v)
    return abs(u - v) / max(abs(u), abs(v), 1e-30)


def configs(params_file: str) -> list[tuple[str, dict]]:
    """``(task, shrunk TrainConfig as a dict)`` for every distinct config of the grids."""
    from apg.fingerprint import shrunk
    from pipeline.config import grid_cells, load_params

    params = load_params(params_file)
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
    from apg.training import TrainConfig
    from pipeline.config import load_params
    from pipeline.generate import simulate_set

    params = load_params(params_file)
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
    parser.add_argument("--params", default="params.yaml")
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
    for name, rows in results.items():
        if name == "default":
            continue
        worst, above, total, agree = 0.0, {3: 0, 4: 0, 5: 0, 6: 0}, 0, 0
        for b, r in zip(base, rows, strict=True):
            same = True
            for (key, u), (_, v) in zip(b["numbers"], r["numbers"], strict=True):
                rel = difference(key, u, v)
                worst = max(worst, rel)
                total += 1
                for digits in above:
                    above[digits] += rel > 0.5 * 10 ** (1 - digits)
                same &= rounded(key, u) == rounded(key, v)
            agree += same
        shown = ", ".join(f"{d} digits: {n}" for d, n in above.items())
        print(
            f"{name:15s} largest difference {worst:.2e} over {total} numbers; above half a "
            f"unit of the last digit kept ({shown}); fingerprints equal for {agree} of {len(rows)} configs"
        )
        for b, r in zip(base, rows, strict=True):
            diffs = [
                (difference(key, u, v), key)
                for (key, u), (_, v) in zip(b["numbers"], r["numbers"], strict=True)
            ]
            rel, key = max(diffs)
            print(
                f"    {b['task']:6s} {b['cfg']['method']:16s} K{b['cfg']['sweeps']} L{b['cfg']['particles']}: "
                f"max {rel:.1e} at {key}; {b['seconds']:.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
