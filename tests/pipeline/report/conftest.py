"""The report stage run once on synthetic GMM results (``synthetic_report``)."""

from __future__ import annotations

import pytest
import torch

from pipeline import report
from tests.pipeline.report.synthetic import write_results


@pytest.fixture
def synthetic_report(tmp_path):
    write_results(tmp_path, with_training_trend=True)
    params = {
        "tasks": ["gmm"],
        "report": {"out": "reports", "figure_format": "png", "scale": "synthetic"},
    }
    torch.set_num_threads(1)
    report.make_report(params, tmp_path)
    return tmp_path / "reports"
