"""Recorded profiles: a profile too large for ``dvc repro`` run in a resumable sandbox and
kept in ``recorded/<profile>/`` (``apg-pipeline record``).

- :mod:`pipeline.recorded.record`: the sandbox, the cells kept across restarts, the
  manifest, and the recorded runs the report lists;
- :mod:`pipeline.recorded.direct`: a profile trained in-process on one machine (no Ray,
  MLflow or DVC: ``--direct``);
- :mod:`pipeline.recorded.files`: what a recorded run's folder holds and how it is read.

``record`` and ``direct`` plan: they call the stages, the run layer and the config, and
only the CLI imports them. The report reads recorded runs through ``files`` alone.
"""
