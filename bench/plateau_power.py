"""The plateau test's power: would it notice a given rise over the last fifth of training?

For each cell of a committed report's training rows (``reports/data/<task>/training.parquet``),
and for each configuration trained with several seeds (the cells that differ only by seed,
``pipeline.report.training.configurations``), the plateau test's standard error of the
window's change in the training log joint (``plateau``: OLS over a cell's last fifth;
``pooled_plateau``: one slope common to the seeds, an intercept per seed; the batch-to-batch
scatter as the noise) and the probability that it flags a true linear rise of ``--rise`` nats
over the window: ``P(|T| >= 3)`` for ``T`` noncentral t with ``rise / se`` and the test's
degrees of freedom (``N - S - 1``: 16 for one cell of 18 points, 169 for ten such seeds). Also
the test's own verdict on the curves.

    python bench/plateau_power.py --task dgmm --rise 99
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from scipy import stats

from pipeline.report.training import PLATEAU_Z, Plateau, configurations, plateau, pooled_plateau


def power(rise: float, st: Plateau, curves: int) -> float:
    """``P(|T| >= PLATEAU_Z)`` for ``T`` noncentral t on the fit's ``points - curves - 1``
    degrees of freedom with noncentrality ``rise / se``."""
    if not st.se > 0:
        return 1.0
    dof, ncp = st.points - curves - 1, rise / st.se
    return float(stats.nct.sf(PLATEAU_Z, dof, ncp) + stats.nct.cdf(-PLATEAU_Z, dof, ncp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="dgmm")
    parser.add_argument("--rise", type=float, default=99.0, help="nats over the last fifth")
    parser.add_argument("--reports", default="reports")
    args = parser.parse_args()
    data = Path(args.reports) / "data" / args.task
    rows = pd.read_parquet(data / "training.parquet")
    rows = rows[rows["metric"] == "log_joint"]
    curves = {cid: (c["iteration"].to_numpy(), c["value"].to_numpy()) for cid, c in rows.groupby("cell_id")}
    own = {cid: plateau(*curve) for cid, curve in sorted(curves.items())}
    print(f"| cell | points | change over the window | se | z | plateaued | power at {args.rise:g} nats |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for cid, st in own.items():
        print(
            f"| {cid} | {st.points} | {st.delta:.1f} | {st.se:.1f} | {st.z:.2f} | {st.plateaued} | "
            f"{power(args.rise, st, 1):.3f} |"
        )
    groups: dict[str, list[str]] = {}
    for cid, name in configurations(json.loads((data / "meta.json").read_text())["cells"]).items():
        if cid in own and own[cid].plateaued is not None:
            groups.setdefault(name, []).append(cid)
    print()
    print(
        f"| configuration | seeds | points | change over a window | se | z | plateaued | power at {args.rise:g} nats |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, ids in sorted(groups.items()):
        if len(ids) < 2:
            continue
        st = pooled_plateau([curves[cid] for cid in ids])
        print(
            f"| {name} | {len(ids)} | {st.points} | {st.delta:.1f} | {st.se:.1f} | {st.z:.2f} | {st.plateaued} | "
            f"{power(args.rise, st, len(ids)):.3f} |"
        )


if __name__ == "__main__":
    main()
