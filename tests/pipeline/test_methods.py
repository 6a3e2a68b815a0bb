"""Every method of apg.baselines through the pipeline: its options reach the cell and its id,
the rings accept the gradient baselines, and ``dvc repro`` tabulates each one."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from pipeline.config.params import ParamsError, grid_cells, validate_params
from tests.pipeline.harness import make_repo, run, tiny


def test_method_options_reach_the_cell_and_name_the_key(tiny):
    params = tiny(
        **{
            "gmm.grid": [{"methods": ["apg", "hmc-rws"], "pairs": [[2, 3]], "seeds": [0]}],
            "gmm.train.method_options": {"hmc-rws": {"step_size": 0.02, "leapfrog_steps": 3}},
        }
    )
    validate_params(params)
    cells = {c.method: c for c in grid_cells(params, "gmm")}
    assert cells["hmc-rws"].train.method_options == {"step_size": 0.02, "leapfrog_steps": 3}
    assert cells["apg"].train.method_options == {}
    # apg's id does not depend on another method's options.
    assert cells["apg"].cell_id("d") == grid_cells(tiny(), "gmm")[0].cell_id("d")
    params["gmm"]["train"]["method_options"] = {"hmc-rws": {"step_size": -1}}
    with pytest.raises(ParamsError, match=r"gmm\.train\.method_options\.hmc-rws\.step_size"):
        validate_params(params)


def tiny_params(task: str, methods: list[str]) -> dict:
    """The pipeline tests' tiny params with ``task`` alone, its grid ``methods`` at (K, L) = (2, 3)."""
    params = tiny()
    section = params.pop("gmm")
    if task == "dgmm":  # the GMM's tiny section on rings of 15 points
        section["data"] = {
            kind: {**entry, "sizes": {"num_points": 15, "radius": 2.0}}
            for kind, entry in section["data"].items()
            if kind != "figures"
        }
        section["data"]["figures"] = [
            {"num_datasets": 1, "seed": 3, "sizes": {"num_points": 30, "radius": 2.0}}
        ]
    section["grid"] = [{"methods": methods, "pairs": [[2, 3]], "seeds": [0]}]
    section["train"]["method_options"] = {"hmc-rws": {"step_size": 0.03, "leapfrog_steps": 2}}
    params["tasks"] = [task]
    params[task] = section
    return params


def test_rings_validate_with_the_gradient_baselines_but_not_bootstrap_gibbs():
    params = tiny_params("dgmm", ["apg", "hmc-rws", "reparam"])
    validate_params(params)
    assert sorted(c.method for c in grid_cells(params, "dgmm")) == ["apg", "hmc-rws", "reparam"]
    params["dgmm"]["grid"][0]["methods"].append("gibbs-bootstrap")  # the GMM only (issue 7)
    with pytest.raises(ParamsError, match=r"dgmm\.network: .*prior_globals.*\(method gibbs-bootstrap\)"):
        validate_params(params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "task, methods",
    [
        ("gmm", ["apg", "rws-mlp", "gibbs", "gibbs-bootstrap", "hmc-rws", "reparam"]),
        ("dgmm", ["apg", "rws-mlp", "hmc-rws", "reparam"]),  # no exact conditionals: no Gibbs, no KL
    ],
)
def test_every_method_runs_through_the_pipeline(tmp_path, task, methods):
    root = make_repo(tmp_path, tiny_params(task, methods))
    run(["dvc", "repro"], root)
    table = pd.read_csv(root / "reports" / "tables" / f"{task}_methods.csv")
    assert sorted(set(table["method"])) == sorted(methods)
    for column in ("log_joint", "ess", "log_evidence", "log_evidence_is"):
        assert table[column].map(math.isfinite).all(), column
    assert table["cells"].str.len().gt(0).all() and table["runs"].str.len().gt(0).all()
    text = (root / "reports" / "README.md").read_text()
    assert "Methods at equal sample budgets" in text and "hmc-rws" in text
    # HMC's acceptance rate: a column of the methods table, and logged in training (MLflow)
    hmc = table[table["method"] == "hmc-rws"]
    assert (
        hmc["accept"].between(0.0, 1.0).all() and table[table["method"] != "hmc-rws"]["accept"].isna().all()
    )
    history = pd.read_parquet(root / "results" / "eval" / task / "training.parquet")
    assert not history[(history["method"] == "hmc-rws") & (history["metric"] == "accept")].empty
    figures = [f"{task}_methods_sweeps.png"] + (["gmm_kl.png"] if task == "gmm" else [])
    for name in figures:
        assert (root / "reports" / "figures" / name).is_file(), name
