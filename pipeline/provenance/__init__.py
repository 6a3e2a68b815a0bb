"""What produced the committed results, and whether they are the checkout's own.

- :mod:`pipeline.provenance.stages`: the code and params each stage reads (from
  ``dvc.yaml``), their digests, the stages' times;
- :mod:`pipeline.provenance.numerics`: what the stages compute, as short digests;
- :mod:`pipeline.provenance.record`: ``reports/provenance.json``, its check, the stale line,
  and ``refresh`` (``python -m pipeline.provenance check|mark|refresh``).

Imports the config and, for the numerics, the stages' own functions (lazily); never the
report.
"""
