"""The pipeline around :mod:`apg`: DVC stages, Ray Tune sweeps, MLflow tracking, reports."""
