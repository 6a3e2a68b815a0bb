"""Continuing runs: any cell of any profile, trained a sitting at a time on any machine.

A run is a folder (under ``recorded/``, kept in git) that any machine continues from where
the last one stopped: ``apg-pipeline continue RUN --minutes N`` on 2 CPU cores at low
priority or on a GPU, then ``git add`` the folder. What a run is (``run.json``) lives in
:mod:`pipeline.runs.spec`, the executor that advances one and the files it writes in
:mod:`pipeline.runs.execute`, the compact form of its state in :mod:`pipeline.runs.compact`,
the training loop every caller drives (sweep and search trials, ``train``, recorded
profiles and runs) in :mod:`pipeline.runs.loop`, a run as a Ray Tune trial (the sweep's and
the search's: setup, resume, MLflow rows, Tune reports) in :mod:`pipeline.runs.trial`, and a run's evaluation on its profile's
held-out grid (``apg-pipeline grid``) in :mod:`pipeline.runs.grid`.

Imports: :mod:`apg`, and the pipeline's config (profiles, grids), common helpers, training
loop (:mod:`pipeline.runs.loop`), evaluation helpers and provenance lines. Never a planner (the
sweep, the search, recorded profiles) and never the report: they read a run's files.
"""
