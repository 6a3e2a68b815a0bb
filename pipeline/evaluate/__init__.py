"""The evaluate stage: every trained cell scored on the held-out sets, as long tables of
rows the report reads.

- :mod:`pipeline.evaluate.stage`: the cells loaded and run at each test-time budget
  (:func:`apg.training.evaluate`, and the final particle's scores of :mod:`apg.particles`),
  ``results/eval/<task>/`` written (``python -m pipeline.evaluate --task gmm``);
- :mod:`pipeline.evaluate.impute`: imputations of hidden entries;
- :mod:`pipeline.evaluate.logged`: the held-out numbers logged to each cell's MLflow run.

Imports the config and :mod:`apg`; never the sweep, a planner or the report.
"""
