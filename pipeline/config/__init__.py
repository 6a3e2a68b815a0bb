"""What a run is asked to do: ``params.yaml``, its profiles, and every value checked where it
enters.

- :mod:`pipeline.config.params`: the params file read and validated, a task's grid expanded
  into cells (:class:`~pipeline.config.params.Cell`: a typed training config and a seed),
  the held-out sets and evaluation pairs;
- :mod:`pipeline.config.schema`: the keys and ranges each params section may hold;
- :mod:`pipeline.config.profiles`: the profiles (``profiles/*.yaml``), overlays of the
  params;
- :mod:`pipeline.config.checks`: command-line values checked at the edge (one line, exit 2).

Imports :mod:`apg` (training configs, tasks) and the provenance's list of stage code; never
a stage, a planner or the report.
"""
