"""Bouncing MNIST (paper section 5.5, Figures 3-4, Appendix E): the task's ``TASK`` and its
public names.

Modules: ``config`` (sizes, hyperparameters, block names), ``likelihood`` (placing digits,
the frames' likelihood, correlations), ``model`` (the generative model), ``simulator``
(bouncing videos), ``proposals`` (the networks), ``metrics`` (tracking error),
``imputation`` (occlusions hidden and scored), ``plots`` (frames with boxes, GIFs).

Legend: L particles, B videos, T frames, D digits, H canvas side.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

from apg.blocks import TaskSpec
from apg.tasks.bmnist.config import CANVAS, DIGIT, FRAME_CHUNK, BMNISTConfig, stack_where, where_key
from apg.tasks.bmnist.imputation import IMPUTATION, occlusion_mask, occlusion_name
from apg.tasks.bmnist.likelihood import (
    blend,
    correlate,
    crop,
    cross_correlations,
    frame_log_likelihood,
    pixel_offsets,
    place,
    render,
)
from apg.tasks.bmnist.metrics import (
    TRACK,
    TRACK_TOLERANCE_PX,
    ink_centres,
    position_errors,
    position_truth,
    tracked_positions,
    tracking_errors,
)
from apg.tasks.bmnist.model import BouncingMNIST, Decoder, build_model, reconstruct, sample_data
from apg.tasks.bmnist.plots import animate, draw
from apg.tasks.bmnist.proposals import (
    BMNISTProposals,
    ExplainingAwayWhere,
    WhatNet,
    WhereNet,
    build_proposals,
)
from apg.tasks.bmnist.simulator import reflect, simulate, simulate_trajectories

TASK = TaskSpec(
    "bmnist",
    build_model,
    build_proposals,
    simulate,
    ("apg", "mlp"),
    ("T", "H", "W"),
    reconstruct=reconstruct,
    sample_data=sample_data,
    draw=draw,
    animate=animate,
    tracking=TRACK,
    imputation=IMPUTATION,
)

__all__ = [
    "BMNISTConfig",
    "BMNISTProposals",
    "BouncingMNIST",
    "CANVAS",
    "DIGIT",
    "Decoder",
    "ExplainingAwayWhere",
    "FRAME_CHUNK",
    "IMPUTATION",
    "TASK",
    "TRACK",
    "TRACK_TOLERANCE_PX",
    "WhatNet",
    "WhereNet",
    "animate",
    "blend",
    "build_model",
    "build_proposals",
    "correlate",
    "crop",
    "cross_correlations",
    "draw",
    "frame_log_likelihood",
    "ink_centres",
    "occlusion_mask",
    "occlusion_name",
    "pixel_offsets",
    "place",
    "position_errors",
    "position_truth",
    "reconstruct",
    "reflect",
    "render",
    "sample_data",
    "simulate",
    "simulate_trajectories",
    "stack_where",
    "tracked_positions",
    "tracking_errors",
    "where_key",
]
