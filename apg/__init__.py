"""Amortized population Gibbs (APG) samplers with neural sufficient statistics.

The library: :mod:`apg.smc` (log-weights, resampling, the sweep loop), :mod:`apg.blocks`
(a task's block structure), :mod:`apg.training` (the objectives' trainer), :mod:`apg.tasks`
(one module per task), :mod:`apg.baselines` (one module per method), :mod:`apg.metrics` and
:mod:`apg.particles` (held-out scores); files: :mod:`apg.data` (datasets),
:mod:`apg.checkpoint` (checkpoints), :mod:`apg.loading` (both, checked against their task).
Nothing here imports :mod:`pipeline`: the arrows point from the pipeline to the library.
"""
