"""The plateau test's power: would it notice a given rise over a cell's last fifth of training?

For each cell of a committed report's training rows (``reports/data/<task>/training.parquet``),
the plateau test's standard error of the window's change in the training log joint
(``pipeline.report.training.plateau``: OLS over the last fifth, the batch-to-batch scatter as
its noise) and the probability that it flags a true linear rise of ``--rise`` nats over that
window: ``P(|Z| >= 3)`` for ``Z ~ N(rise / se, 1)``. Also the test's own verdict on the curve.

    python bench/plateau_power.py --task dgmm --rise 99
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

from pipeline.report.training import PLATEAU_Z, plateau


def power(rise: float, se: float) -> float:
    """``P(|N(rise/se, 1)| >= PLATEAU_Z)``."""
    if not se > 0:
        return 1.0
    mu = rise / se
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    return (1 - cdf(PLATEAU_Z - mu)) + cdf(-PLATEAU_Z - mu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="dgmm")
    parser.add_argument("--rise", type=float, default=99.0, help="nats over the last fifth")
    parser.add_argument("--reports", default="reports")
    args = parser.parse_args()
    rows = pd.read_parquet(Path(args.reports) / "data" / args.task / "training.parquet")
    rows = rows[rows["metric"] == "log_joint"]
    print(f"| cell | points | change over the window | se | z | plateaued | power at {args.rise:g} nats |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for cell_id, curve in rows.groupby("cell_id", sort=True):
        st = plateau(curve["iteration"].to_numpy(), curve["value"].to_numpy())
        print(
            f"| {cell_id} | {st.points} | {st.delta:.1f} | {st.se:.1f} | {st.z:.2f} | {st.plateaued} | "
            f"{power(args.rise, st.se):.3f} |"
        )


if __name__ == "__main__":
    main()
