"""Stage ``report``: tables and figures from recorded results only (never retrains).

``python -m pipeline.report`` reads ``results/eval/<task>/`` for every task in
``tasks`` and writes into ``reports/``:

- ``README.md``: the index, with every table and figure and the scale it was made at; it
  opens with the claims table: the paper's claims (``paper_numbers.yaml``, ``claims``)
  checked against the evaluation metrics with 95% intervals over seeds (``check_claim``);
- ``tables/<task>_training.{md,csv}``: per cell, whether its training log joint and ESS/L
  have plateaued (``plateau``: the OLS trend over the last fifth of training against its
  standard error; ``pooled_plateau``: the same over the seeds of its configuration, one
  common slope). Rows of every other table (and claims) whose numbers come from a cell that
  has not plateaued, on its own or pooled with its seeds, carry ``†`` (not assessable: ``‡``);
- ``tables/<task>_table1.{md,csv}``: Table 1 (our numbers, the paper's beside them);
- ``tables/<task>_methods.{md,csv}``: every method at the same sample budgets K*L: held-out
  log joint, ESS/L, both log-evidence estimates and HMC's acceptance rate, mean and std
  over seeds, with the cell ids and MLflow run ids each number comes from;
- ``figures/<task>_budget.png``: Figure 2, log joint and ESS/L versus K at K*L fixed: cells
  retrained per budget (solid) and one model at test-time budgets (dashed);
- ``figures/<task>_sweeps.png``: convergence versus sweeps; ``<task>_training.png``: the
  training log joint of every cell, one panel per method;
- ``figures/<task>_methods_sweeps.png``: every method's held-out log joint versus sweeps
  (when several methods run sweeps: APG and the companion-paper samplers on the GMM);
- ``figures/<task>_kl.png``: inclusive KL of the block kernels to the exact Gibbs
  conditionals, per block (tasks with exact conditionals);
- ``figures/<task>_compute.png``: reconstruction MSE versus compute (likelihood
  evaluations per dataset, ``Method.model_evaluations``), per held-out set;
- ``figures/<task>_samples.png``: Figure-1-style pictures (the task's ``draw`` hook),
  and ``<task>_samples.gif`` when the task has an ``animate`` hook;
- ``metrics.json``: the headline for ``dvc metrics show`` / ``dvc exp show``: per task each
  claim's verdict (1 holds, 0 fails, null none) and under ``claims`` the counts;
- ``data/metrics-full.json``: its long form, every cell's headline numbers per task and under
  ``claims`` each checked claim (``task/id``: value, lo, hi, target, pass).

Table 1, the method tables and the claims use each method's main cells (trained at its
grid ``pairs``); cells trained only for Figure 2 (grid ``budget``) feed its solid curve.

Every number is a mean over seeds and held-out datasets; ``std`` columns and shaded
bands are the standard deviation over the same (seed, dataset) pairs (the methods-sweeps
figure shades the standard error instead, and says so).

The package, one module per concern: ``data`` (the rows read and the selections shared),
``training`` (plateau test, marks, stalled seeds), ``tables``, ``claims`` (one rule per
claim kind), ``headline`` (the claims' JSON, short and long, and their counts), ``figures``, ``axes`` (swept settings), ``sections`` (one task's part and the
Markdown around it), ``runs`` (the continuing runs under ``recorded/``, each read the same
way), ``reach`` (when a run would meet its target), ``grid`` (a run's held-out grid and the
claims decided on it) and ``stage`` (``make_report``, recorded runs, the command line).
"""

import matplotlib

matplotlib.use("Agg")  # files only, before any module of the package imports pyplot

from pipeline.report.claims import (  # noqa: E402
    CLAIM_KINDS,
    check_claim,
    claim_target,
    seed_estimate,
    task_claims,
    verdict,
)
from pipeline.report.data import (  # noqa: E402
    COMMITTED_DATA,
    FULL_METRICS,
    PAPER_NUMBERS,
    finals,
    load_results,
    main_rows,
    retrained_rows,
    training_length,
)
from pipeline.report.headline import claims_json, headline_metrics  # noqa: E402
from pipeline.report.stage import main, make_report, recorded_markdown  # noqa: E402
from pipeline.report.training import (  # noqa: E402
    plateau,
    pooled_plateau,
    stalled_markdown,
    stalled_seeds,
)
from pipeline.statistics import seed_interval  # noqa: E402

__all__ = [
    "CLAIM_KINDS",
    "COMMITTED_DATA",
    "FULL_METRICS",
    "PAPER_NUMBERS",
    "check_claim",
    "claim_target",
    "claims_json",
    "finals",
    "headline_metrics",
    "load_results",
    "main",
    "main_rows",
    "make_report",
    "plateau",
    "pooled_plateau",
    "recorded_markdown",
    "retrained_rows",
    "seed_estimate",
    "stalled_markdown",
    "stalled_seeds",
    "task_claims",
    "training_length",
    "verdict",
    "seed_interval",
]
