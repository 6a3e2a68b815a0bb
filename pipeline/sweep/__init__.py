"""The sweep stage: every cell of a task's grid trained once, as Ray Tune trials, each
recorded in MLflow.

- :mod:`pipeline.sweep.stage`: the plan (cell ids from config, data and numerics
  fingerprint), the Ray Tune run, the summary ``results/<task>/sweep.json``
  (``python -m pipeline.sweep --task gmm``);
- :mod:`pipeline.sweep.trial`: one trial, a cell trained by the run layer's loop
  (:mod:`pipeline.runs.loop`) with Tune's reports and checkpoints;
- :mod:`pipeline.sweep.ray_setup`, :mod:`pipeline.sweep.reaper`: Ray started quietly, and
  the processes a killed driver left behind.

Imports the config, the run layer, tracking and the provenance's stage times; never the
search, recorded profiles or the report.
"""
