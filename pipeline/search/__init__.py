"""The hyperparameter search (``apg-pipeline tune``, ``tuning/dvc.yaml``): a search space
over a task's training and network settings, sampled and pruned by Ray Tune, its best
settings written for the params.

- :mod:`pipeline.search.plan`: the space and the search's settings (``tune.yaml``) checked;
- :mod:`pipeline.search.stage`: the trials run (``python -m pipeline.search``), each a cell
  trained by the run layer's loop;
- :mod:`pipeline.search.report`: the trials' table, figure and best settings.

Imports the config, the run layer and the sweep's Ray set-up; never the report.
"""
