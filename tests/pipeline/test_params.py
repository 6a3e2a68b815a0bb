"""The pipeline's params and fail-fast paths, without Ray: validation of every key with a
one-line error, the grid and its cells, trial order, the smoke profile mirroring the
defaults, unreachable services.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import yaml

from apg.training import TrainConfig
from pipeline import tracking
from pipeline.config.params import ParamsError, grid_cells, validate_params
from pipeline.config.schema import STATED_TRAIN_KEYS
from pipeline.errors import SweepError
from pipeline.sweep.ray_setup import check_ray_address
from tests.pipeline.harness import TINY
from tests.support import REPO


def test_tiny_params_are_valid(tiny):
    validate_params(tiny())
    cells = grid_cells(tiny(), "gmm")
    assert [c.name for c in cells] == ["gmm/apg/K2/L3/seed0", "gmm/rws-mlp/K2/L3/seed0"]


def test_a_cells_numbers_come_from_the_params_alone(tiny):
    """params.yaml is the one home of defaults: TrainConfig defaults none of a cell's numbers,
    and params that leave one out are refused in one line, naming it."""
    undefaulted = {
        f.name
        for f in dataclasses.fields(TrainConfig)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert undefaulted == {"task", "method", "sweeps", "particles", *STATED_TRAIN_KEYS}
    params = tiny()
    del params["gmm"]["train"]["lr"]
    with pytest.raises(ParamsError, match=r"^gmm.train: set lr \(a cell's numbers have no default\)$"):
        validate_params(params)


def test_budget_grid_expands_to_pairs(tiny):
    params = tiny(
        **{"gmm.grid": [{"methods": ["apg"], "budget": {"total": 20, "sweeps": [2, 5]}, "seeds": [0, 1]}]}
    )
    assert sorted((c.sweeps, c.particles, c.seed) for c in grid_cells(params, "gmm")) == [
        (2, 10, 0),
        (2, 10, 1),
        (5, 4, 0),
        (5, 4, 1),
    ]


def test_cell_id_changes_with_any_option(tiny):
    base = grid_cells(tiny(), "gmm")[0].cell_id("data")
    assert grid_cells(tiny(), "gmm")[0].cell_id("data") == base
    assert grid_cells(tiny(**{"gmm.train.iterations": 7}), "gmm")[0].cell_id("data") != base
    assert grid_cells(tiny(), "gmm")[0].cell_id("other data") != base


def test_axes_cross_any_key_with_methods_and_seeds(tiny):
    entry = {
        "methods": ["apg"],
        "pairs": [[2, 3]],
        "seeds": [0, 1],
        "axes": {"network.hidden": [8, 16], "train.lr": [0.01, 0.003]},
    }
    cells = grid_cells(tiny(**{"gmm.grid": [TINY["gmm"]["grid"][0], entry]}), "gmm")
    swept = [c for c in cells if c.axes]
    # hidden 8 with lr 0.01 at seed 0 is the first entry's cell: trained once, under its name
    assert len(cells) == 2 + 2 * 4 - 1 and len(swept) == 2 * 4 - 1
    by_setting = {(c.train.network["hidden"], c.train.lr, c.seed): c for c in cells if c.method == "apg"}
    assert len(by_setting) == 8
    assert by_setting[(8, 0.01, 0)].name == "gmm/apg/K2/L3/seed0"
    one = by_setting[(16, 0.003, 1)]
    assert one.name == "gmm/apg/K2/L3/seed1/network.hidden=16,train.lr=0.003"
    assert one.axes == (("network.hidden", 16), ("train.lr", 0.003))
    assert len({c.name for c in cells}) == len({c.cell_id("d") for c in cells}) == len(cells)


def test_an_entry_sets_its_methods_own_network_and_rate(tiny):
    """A baseline at its own searched width and rate keeps its method's name (the claims
    read cells by method); the other entries keep the task's network."""
    apg = {"methods": ["apg"], "pairs": [[2, 3]], "seeds": [0]}
    mlp = {**apg, "methods": ["rws-mlp"], "network": {"hidden": 16}, "train": {"lr": 0.003}}
    cells = {c.method: c for c in grid_cells(tiny(**{"gmm.grid": [apg, mlp]}), "gmm")}
    assert cells["rws-mlp"].name == "gmm/rws-mlp/K2/L3/seed0" and not cells["rws-mlp"].axes
    assert cells["rws-mlp"].train.network["hidden"] == 16 and cells["rws-mlp"].train.lr == 0.003
    assert cells["apg"].train.network == TINY["gmm"]["network"]
    default = {c.method: c for c in grid_cells(tiny(), "gmm")}["rws-mlp"]
    assert cells["rws-mlp"].cell_id("d") != default.cell_id("d")
    validate_params(tiny(**{"gmm.grid": [apg, mlp]}))
    with pytest.raises(ParamsError, match=r"gmm.grid\[1\].network: must be dict"):
        validate_params(tiny(**{"gmm.grid": [apg, {**mlp, "network": 16}]}))
    with pytest.raises(ParamsError, match=r"gmm.grid \(gmm/rws-mlp/K2/L3/seed0\): .*widht"):
        validate_params(tiny(**{"gmm.grid": [apg, {**mlp, "network": {"widht": 16}}]}))


@pytest.mark.parametrize(
    "axes, expected",
    [
        ({"netwrk.hidden": [8]}, "gmm.grid[0].axes.netwrk.hidden: axes are <section>.<key>"),
        ({"train.lr_final": [0.1]}, "gmm.grid[0].axes.train.lr_final: unknown training key; did you mean"),
        ({"train.lr": []}, "gmm.grid[0].axes.train.lr: must be a non-empty list"),
        ({"train.lr": ["fast"]}, "gmm.grid[0].axes.train.lr[0]: wrong type for train.lr"),
        ({"train.lr": [-0.1]}, "gmm.grid[0].axes.train.lr: lr must be a positive number"),
        ({"network.hiden": [8]}, "gmm.grid (gmm/apg/K2/L3/seed0/network.hiden=8): "),
        ({"model.nu_0": [0.3]}, "gmm.grid (gmm/apg/K2/L3/seed0/model.nu_0=0.3): "),
    ],
)
def test_bad_axes_name_the_key(axes, expected, tiny):
    with pytest.raises(ParamsError) as info:
        validate_params(tiny(**{"gmm.grid.0.axes": axes}))
    assert "\n" not in str(info.value) and str(info.value).startswith(expected), str(info.value)


def test_trials_start_longest_first(tiny):
    # The rings' hmc-rws cell (a leapfrog per transition) once ran alone for 22 minutes at the
    # end of the sweep; ordered by estimated cost it starts first, gibbs (nothing to train) last.
    from pipeline.sweep.stage import estimated_cost

    grid = [{"methods": ["rws-mlp", "gibbs", "apg", "hmc-rws"], "pairs": [[2, 3]]}]
    cells = grid_cells(tiny(**{"gmm.grid": grid}), "gmm")
    order = [c.method for c in sorted(cells, key=lambda c: -estimated_cost(c))]
    assert order[0] == "hmc-rws" and order.index("apg") < order.index("rws-mlp")
    iterations = tiny(**{"gmm.train.iterations": 12, "gmm.grid": grid})
    assert estimated_cost(grid_cells(iterations, "gmm")[0]) == 2 * estimated_cost(cells[0])


def test_the_evaluation_runs_on_its_own_thread_count(tmp_path, monkeypatch, tiny):
    # The evaluate stage runs alone after the sweep, so it may use every core; without the key
    # it keeps a trial's count. A count below one is refused by name.

    from pipeline.evaluate import stage as evaluate

    with pytest.raises(ParamsError, match=r"^gmm.evaluate.threads: too small \(0\)$"):
        validate_params(tiny(**{"gmm.evaluate.threads": 0}))
    seen = []
    monkeypatch.setattr(
        evaluate, "evaluate_task", lambda *a: seen.append(torch.get_num_threads()) or {"cells": {}}
    )
    monkeypatch.setattr(evaluate, "record_stage_time", lambda *a: None)
    before = torch.get_num_threads()
    try:
        for params, expected in ((tiny(**{"gmm.evaluate.threads": 2}), 2), (tiny(), 1)):
            path = tmp_path / "params.yaml"
            path.write_text(yaml.safe_dump(params))
            evaluate.main(["--task", "gmm", "--params", str(path), "--out", str(tmp_path / "out")])
            assert seen[-1] == expected
        assert seen == [2, 1]
    finally:
        torch.set_num_threads(before)


def test_the_printed_mlflow_address_opens_the_runs_table():
    view = "runs?workflowType=machine_learning&viewStateShareKey=apg-headline"
    assert tracking.ui_url("http://host:5000/", "7") == f"http://host:5000/#/experiments/7/{view}"
    assert tracking.ui_url("http://host:5000/", "7", "ab12") == "http://host:5000/#/experiments/7/runs/ab12"
    assert tracking.browse_hint("http://u:secret@host:5000", "7").endswith(
        f"http://***@host:5000/#/experiments/7/{view}"
    )
    local = tracking.browse_hint("sqlite:////tmp/x/mlflow.db", "1")
    assert (
        "mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db" in local
        and "127.0.0.1:5000/#/experiments/1/runs?" in local
    )
    claims = tracking.browse_hint("sqlite:////tmp/x/mlflow.db", "1", "ab12", "the claims")
    assert claims.startswith("browse the claims: mlflow ui") and claims.endswith(
        ":5000/#/experiments/1/runs/ab12"
    )


def test_two_experiments_under_one_name_are_an_error(tiny):
    entry = {"methods": ["apg"], "pairs": [[2, 3]], "train": {"iterations": 9}}
    with pytest.raises(ParamsError, match="two entries train gmm/apg/K2/L3/seed0 with different settings"):
        grid_cells(tiny(**{"gmm.grid": [TINY["gmm"]["grid"][0], entry]}), "gmm")


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"gmm.trian": {}}, "gmm.trian: unknown key; did you mean 'train'?"),
        ({"sweep.cpus_per_trail": 1}, "sweep.cpus_per_trail: unknown key; did you mean 'cpus_per_trial'?"),
        ({"gmm.grid.0.methods": ["apg", "vae"]}, "gmm.grid[0].methods[1]: unknown method 'vae'"),
        ({"tasks": ["gmm", "nope"]}, "tasks[1]: unknown task 'nope'"),
        ({"gmm.grid.0.pairs": [[0, 3]]}, "gmm.grid[0].pairs[0]: K must be >= 1"),
        ({"gmm.grid.0.pairs": [[2, 1]]}, "gmm.grid[0].pairs[0]: L must be >= 2"),
        ({"gmm.evaluate.pairs": [[2, 1]]}, "gmm.evaluate.pairs[0]: L must be >= 2"),
        (
            {"gmm.grid.0.budget": {"total": 4, "sweeps": [5]}},
            "gmm.grid[0].budget.total: budget 4 is smaller than K=5",
        ),
        (
            {"gmm.evaluate.budget": {"total": 4, "sweeps": [5]}},
            "gmm.evaluate.budget.total: budget 4 is smaller than K=5",
        ),
        ({"gmm.train.lr": -0.1}, "gmm.train.lr: lr must be a positive number"),
        ({"gmm.train.iterations": "many"}, "gmm.train.iterations: must be int"),
        ({"gmm.model": {"nu_0": 0.3}}, "gmm.model: "),
        ({"gmm.network": {"hiden": 8}}, "gmm.network: "),
        ({"sweep.gpus_per_trial": -1}, "sweep.gpus_per_trial: must be >= 0"),
        ({"gmm.evaluate.imputation": {"methods": []}}, "gmm.evaluate.imputation.methods: list the methods"),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "fill": "zeros"}},
            "gmm.evaluate.imputation.fill: sample (draw from p(x | z)) or mean",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "iterations": 3, "burn_in": 3}},
            "gmm.evaluate.imputation.burn_in: must be below iterations",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "test_set": "nope"}},
            "gmm.evaluate.imputation.test_set: 'nope' is not a test set",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "occlusions": [{"frames": 0}]}},
            "gmm.evaluate.imputation.occlusions[0]: bad bounds",
        ),
        (
            {
                "gmm.evaluate.imputation": {
                    "methods": ["apg"],
                    "occlusions": [{"rows": [5, 2], "cols": [0, 3]}],
                }
            },
            "gmm.evaluate.imputation.occlusions[0]: bad bounds",
        ),
        (
            {"gmm.evaluate.imputation": {"methods": ["apg"], "mask": 1}},
            "gmm.evaluate.imputation.mask: unknown key",
        ),
        (
            {"gmm.data.train": {"num_datasets": 4, "seed": 0, "sizes": {"num_points": -3}}},
            "gmm.data.train.sizes.num_points: must be positive, got -3",
        ),
        (
            {"gmm.data.test": {"num_datasets": 4, "seed": 0, "sizes": {"num_points": 0}}},
            "gmm.data.test.sizes.num_points: must be positive, got 0",
        ),
    ],
)
def test_bad_params_name_the_key(changes, expected, tiny):
    with pytest.raises(ParamsError) as info:
        validate_params(tiny(**changes))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected), message


def test_sweep_stage_fails_before_ray_starts(tmp_path, capsys, tiny):
    import ray

    from pipeline.sweep.stage import main

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tiny(**{"gmm.grid.0.pairs": [[2, 1]]})))
    with pytest.raises(SystemExit) as info:
        main(["--task", "gmm", "--params", str(path)])
    assert info.value.code == 2
    assert (
        capsys.readouterr().err.strip() == "apg-pipeline: error: gmm.grid[0].pairs[0]: L must be >= 2, got 1"
    )
    assert not ray.is_initialized()


def test_committed_params_file_is_valid():
    from pipeline.config.params import load_params

    params = load_params(REPO / "params.yaml")  # the profiles: tests/pipeline/test_config_overlays.py
    assert all(grid_cells(params, task) for task in params["tasks"])


def test_unreachable_services_fail_fast():
    start = time.perf_counter()
    with pytest.raises(tracking.TrackingError, match="http://127.0.0.1:9"):
        tracking.check_reachable("http://127.0.0.1:9")
    with pytest.raises(SweepError, match="127.0.0.1:9"):
        check_ray_address("127.0.0.1:9")
    assert time.perf_counter() - start < 15


def test_smoke_profile_mirrors_the_defaults():
    # The smoke profile is only worth running if it exercises what params.yaml runs.
    from pipeline.config.profiles import resolve

    full, smoke = yaml.safe_load((REPO / "params.yaml").read_text()), resolve("smoke")
    assert smoke["tasks"] == full["tasks"]
    assert set(smoke["sweep"]) == set(full["sweep"])
    for task in full["tasks"]:
        assert set(smoke[task]) == set(full[task]), task
        assert set(smoke[task]["train"]) == set(full[task]["train"]), task
        methods = [[sorted(e["methods"]), sorted(e)] for e in full[task]["grid"]]
        assert [[sorted(e["methods"]), sorted(e)] for e in smoke[task]["grid"]] == methods, task
        assert set(smoke[task]["evaluate"]) == set(full[task]["evaluate"]), task
