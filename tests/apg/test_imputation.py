"""Missing-data imputation (Rezende et al. 2014, Appendix F; issue 22): the chain of
inference and generation, its mask checks, and the pipeline's masks and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from apg.baselines import get_method
from apg.imputation import MaskError, check_mask, impute, initial_fill
from apg.tasks import get_task
from apg.tasks.bmnist import occlusion_mask
from apg.tasks.gmm import hidden_coordinates, oracle_imputation


def _gmm(num_datasets: int = 4, num_points: int = 40, seed: int = 0):
    spec = get_task("gmm")
    model = spec.build_model()
    arrays = spec.simulate(model, num_datasets, torch.Generator().manual_seed(seed), num_points=num_points)
    return spec, model, {k: v.float() if v.is_floating_point() else v for k, v in arrays.items()}


def test_bad_masks_get_one_line_errors():
    x = torch.zeros(2, 3, 2)
    with pytest.raises(MaskError, match=r"shaped like the data \(2, 3, 2\), got \(2, 3\)"):
        check_mask(x, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(MaskError, match="nothing missing"):
        check_mask(x, torch.zeros(2, 3, 2, dtype=torch.bool))
    everything = torch.zeros(2, 3, 2, dtype=torch.bool)
    everything[1] = True
    with pytest.raises(MaskError, match=r"every entry of dataset\(s\) \[1\] is missing"):
        check_mask(x, everything)
    with pytest.raises(MaskError, match="only 0"):
        check_mask(x, torch.full((2, 3, 2), 2))
    ok = torch.zeros(2, 3, 2, dtype=torch.int64)
    ok[0, 1, 0] = 1
    assert check_mask(x, ok).dtype == torch.bool


def test_the_chain_changes_only_missing_entries_and_records_them():
    torch.manual_seed(0)
    spec, model, arrays = _gmm()
    x = arrays["x"]
    mask = hidden_coordinates(x, 0.25, torch.Generator().manual_seed(1))
    assert (mask.sum(-1) <= 1).all() and (mask.flatten(1).sum(1) == 10).all()
    start = initial_fill(x, mask)
    observed_mean = (x * ~mask).flatten(1).sum(1) / (~mask).flatten(1).sum(1)
    assert torch.allclose(start[mask], observed_mean.repeat_interleave(10))
    gibbs = get_method("gibbs")
    result = impute(gibbs, model, spec.exact_gibbs(model), spec, x, mask, 3, 2, 5)
    assert torch.equal(result.x[~mask], x[~mask])
    assert result.history.shape == (3, int(mask.sum()))
    assert torch.equal(result.history[-1], result.x[mask])
    assert not torch.equal(result.history[0], result.history[1])  # draws, not a fixed point
    assert set(result.z) == {"mu", "tau", "c"} and result.z["c"].shape == (1, 4, 40)
    with pytest.raises(ValueError, match="fill must be one of"):
        impute(gibbs, model, spec.exact_gibbs(model), spec, x, mask, 3, 2, 5, fill="zeros")
    with pytest.raises(ValueError, match="cannot reconstruct"):
        impute(gibbs, model, spec.exact_gibbs(model), spec, x, mask, 3, 2, 5, fill="mean")
    with pytest.raises(ValueError, match="iterations must be"):
        impute(gibbs, model, spec.exact_gibbs(model), spec, x, mask, 0, 2, 5)


@pytest.mark.slow
def test_exact_gibbs_imputation_approaches_the_true_parameter_predictor():
    """With the exact conditionals the chain is a Gibbs sampler of p(z, x_missing | x_obs):
    the mean of its draws estimates E[x_missing | x_obs]. Its squared error against the
    truth can exceed that of the Bayes predictor at the true parameters (which the chain
    does not know) but not fall below it beyond Monte Carlo error; and it must beat the
    chain's start (the dataset's mean). Tolerances measured on 6 data seeds (40 datasets of
    60 points, 30% of points with a coordinate hidden, 150 iterations): the excess was 3-28%
    of the oracle's MSE, the gain over the start 3.0-7.1 standard errors."""
    torch.manual_seed(0)
    spec, model, arrays = _gmm(num_datasets=40, num_points=60, seed=10)
    x = arrays["x"]
    mask = hidden_coordinates(x, 0.3, torch.Generator().manual_seed(20))
    truth = x[mask]
    result = impute(get_method("gibbs"), model, spec.exact_gibbs(model), spec, x, mask, 150, 5, 10)
    chain_sq = (result.history[30:].mean(0) - truth) ** 2
    oracle_sq = (oracle_imputation(x, mask, arrays["mu"], arrays["tau"]) - truth) ** 2
    start_sq = (initial_fill(x, mask)[mask] - truth) ** 2

    def paired(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        """Mean of a - b over the hidden entries, and its standard error."""
        d = a - b
        return d.mean().item(), d.std().item() / math.sqrt(d.numel())

    excess, se = paired(chain_sq, oracle_sq)  # what not knowing the parameters costs
    assert -3 * se < excess < 0.4 * oracle_sq.mean().item(), (excess, se, oracle_sq.mean())
    gain, se = paired(start_sq, chain_sq)
    assert gain > 2 * se, (gain, se)


def test_the_gmm_oracle_is_the_cluster_posterior_mean():
    """Point 0 hides its second coordinate, point 1 nothing; D=3 for point 2 of dataset 1,
    which hides its third: clusters weighed by every observed coordinate."""
    x = torch.tensor([[[0.5, 0.0], [5.0, 1.0]]])
    mask = torch.tensor([[[False, True], [False, False]]])
    mu = torch.tensor([[[0.0, 10.0], [2.0, -10.0], [100.0, 3.0]]])
    tau = torch.tensor([[[4.0, 1.0], [0.25, 1.0], [1.0, 1.0]]])
    log_w = 0.5 * torch.log(tau[0, :, 0]) - 0.5 * tau[0, :, 0] * (0.5 - mu[0, :, 0]) ** 2
    expected = (torch.softmax(log_w, 0) * mu[0, :, 1]).sum()
    assert torch.allclose(oracle_imputation(x, mask, mu, tau), expected.reshape(1))
    x3 = torch.tensor([[[1.0, -1.0, 7.0]]])
    mask3 = torch.tensor([[[False, False, True]]])
    mu3, tau3 = (
        torch.tensor([[[1.0, -1.0, 5.0], [3.0, 2.0, -5.0]]]),
        torch.tensor([[[2.0, 0.5, 1.0], [1.0, 3.0, 1.0]]]),
    )
    lw = (0.5 * torch.log(tau3[0, :, :2]) - 0.5 * tau3[0, :, :2] * (x3[0, 0, :2] - mu3[0, :, :2]) ** 2).sum(
        -1
    )
    assert torch.allclose(
        oracle_imputation(x3, mask3, mu3, tau3), (torch.softmax(lw, 0) * mu3[0, :, 2]).sum().reshape(1)
    )


def test_the_start_ignores_whatever_the_hidden_entries_hold():
    x = torch.tensor([[1.0, float("nan"), 3.0]])
    mask = torch.tensor([[False, True, False]])
    assert torch.equal(initial_fill(x, mask), torch.tensor([[1.0, 2.0, 3.0]]))


def test_task_settings_are_checked_before_any_work():
    from pipeline.evaluate.impute import check_settings

    video_set = {"name": "T5", "sizes": {"num_frames": 5}}
    with pytest.raises(ValueError, match="gmm and bmnist only, not dgmm"):
        check_settings("dgmm", {"methods": ["apg"]}, {}, {"name": "test"})
    with pytest.raises(ValueError, match="fill: task gmm cannot reconstruct"):
        check_settings("gmm", {"methods": ["apg"], "fill": "mean"}, {}, {"name": "test"})
    with pytest.raises(ValueError, match="occlusions: list at least one"):
        check_settings("bmnist", {"methods": ["apg"]}, {}, video_set)
    with pytest.raises(ValueError, match="does not fit the 5-frame videos of T5"):
        check_settings(
            "bmnist", {"methods": ["apg"], "occlusions": [{"start": 4, "frames": 3}]}, {}, video_set
        )
    with pytest.raises(ValueError, match="outside the 96 x 96 frames"):
        check_settings(
            "bmnist", {"methods": ["apg"], "occlusions": [{"rows": [90, 100], "cols": [0, 3]}]}, {}, video_set
        )
    check_settings("bmnist", {"methods": ["apg"], "occlusions": [{"start": 3, "frames": 3}]}, {}, video_set)


def test_occlusions_hide_frames_or_a_region():
    frames = occlusion_mask((2, 6, 8, 8), {"start": 2, "frames": 3})
    assert frames[:, 1:4].all() and not frames[:, [0, 4, 5]].any()
    region = occlusion_mask((2, 6, 8, 8), {"rows": [2, 5], "cols": [0, 3]})
    assert region.sum() == 2 * 6 * 3 * 3 and region[:, :, 2:5, 0:3].all()
    with pytest.raises(ValueError, match="does not fit videos of 6 frames"):
        occlusion_mask((2, 6, 8, 8), {"start": 5, "frames": 3})


def test_gmm_masks_are_seeded():
    x = torch.zeros(3, 20, 2)
    a, b = (hidden_coordinates(x, 0.3, torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a, b) and (a.flatten(1).sum(1) == 6).all()
    assert np.isclose(
        hidden_coordinates(x, 0.01, torch.Generator()).flatten(1).sum(1).float().mean().item(), 1.0
    )


def test_pipeline_imputation_rows_for_both_tasks():
    """``imputation_frame`` on untrained cells: the rows, metrics and examples the report reads."""
    from apg.training import TrainConfig, build
    from pipeline.evaluate.impute import imputation_frame
    from pipeline.report.imputation import imputation_markdown, imputation_table

    torch.manual_seed(0)
    spec, _, arrays = _gmm(num_datasets=3, num_points=12)
    cfg = TrainConfig(
        task="gmm",
        method="apg",
        sweeps=2,
        particles=3,
        network={"hidden": 8},
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    ).validate()
    model, proposals = build(cfg)
    settings = {"methods": ["apg"], "num_datasets": 2, "fraction": 0.25, "iterations": 4, "burn_in": 1}
    numpy_arrays = {k: v.numpy() for k, v in arrays.items()}
    frame, examples = imputation_frame(
        "gmm",
        cfg,
        model,
        proposals,
        settings,
        numpy_arrays,
        2,
        3,
        {"method": "apg", "seed": 0, "train_K": 2, "train_L": 3, "cell_id": "c"},
    )
    assert set(frame["metric"]) == {"rmse", "rmse_draw", "rmse_oracle"}
    assert frame.groupby("metric")["iteration"].max().to_dict() == {
        "rmse": 4,
        "rmse_draw": 4,
        "rmse_oracle": 4,
    }
    assert len(frame[frame["metric"] == "rmse"]) == 2 * 4 and frame["value"].notna().all()
    assert set(examples) == {"0__truth", "0__mask", "0__imputed"} and examples["0__mask"].sum() == 3
    table = imputation_table(frame)
    assert len(table) == 1 and table["seeds"].iloc[0] == 1
    assert "RMSE, true-parameter predictor" in imputation_markdown(table)

    bm = get_task("bmnist")
    cfg = TrainConfig(
        task="bmnist",
        method="apg",
        sweeps=2,
        particles=2,
        network={"num_digits": 1},
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    ).validate()
    model, proposals = build(cfg)
    videos = {
        "x": np.random.default_rng(0).random((2, 4, 96, 96)).astype(np.float16) * 0.1,
        "z_where": np.zeros((2, 4, 1, 2), np.float32),
        "centres": np.full((2, 1, 2), 14.0, np.float32),
    }
    settings = {
        "methods": ["apg"],
        "iterations": 2,
        "fill": "mean",
        "occlusions": [{"start": 2, "frames": 2}, {"rows": [0, 8], "cols": [0, 8]}],
    }
    frame, examples = imputation_frame(
        "bmnist",
        cfg,
        model,
        proposals,
        settings,
        videos,
        2,
        2,
        {"method": "apg", "seed": 0, "train_K": 2, "train_L": 3, "cell_id": "c"},
    )
    assert list(dict.fromkeys(frame["setting"])) == ["frames 2-3", "region 0:8x0:8"]
    assert set(frame["metric"]) == {"mse", "pos_err", "tracked"}
    assert examples["0__mask"].shape == (4, 96, 96) and examples["0__mask"][1:3].all()
    assert bm.sample_data is not None


@pytest.mark.parametrize("task", ["gmm", "bmnist"])
def test_the_report_explains_imputation_in_the_task_s_own_words(task):
    # The report names no task: what the numbers and the figure measure comes from the spec.
    from pipeline.report.sections import figure_text, imputation_text

    spec = get_task(task).imputation
    assert spec.description and spec.figure_description
    text = imputation_text(task, "test_set")
    assert text.endswith(spec.description) and "`test_set`" in text
    caption = figure_text(task, "imputation")
    assert caption.endswith(spec.figure_description)
    other = {"gmm": "bmnist", "bmnist": "gmm"}[task]
    assert get_task(other).imputation.figure_description not in caption
