"""Hyperparameter search (``pipeline/search/stage.py``, ``apg-pipeline tune``).

Fast tests: the search section is checked before Ray starts, with one-line errors. The
slow loopback test runs a real search on a tiny GMM project: ASHA stops trials early,
Ctrl+C interrupts it, and running the command again finishes it without retraining what
was done; MLflow has a parent run and one child run per trial, the best one tagged.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from apg.checkpoint import load_checkpoint
from pipeline.config.params import ParamsError, apply_setting
from pipeline.search.plan import check_section, extremes
from pipeline.search.report import TAG_BEST, TAG_TRIAL, asha_order, read_attempts
from pipeline.search.stage import main
from tests.pipeline.harness import env, make_repo, mlflow_runs, run
from tests.support import REPO

SECTION = {
    "method": "apg",
    "pair": [2, 3],
    "iterations": 120,
    "space": {"train.lr": {"loguniform": [1.0e-6, 0.1]}, "network.hidden": {"choice": [4, 8]}},
    "search": {"algorithm": "random", "num_samples": 6, "seed": 0},
    "scheduler": {"asha": {"grace_period": 10, "reduction_factor": 2}},
    "metric": "log_joint",
    "eval_every": 10,
    "validation": {"num_datasets": 4, "seed": 50, "sizes": {"num_points": 15}},
}


def section(**changes) -> dict:
    out = copy.deepcopy(SECTION)
    out.update(changes)
    return out


def test_a_good_section_plans_the_search(tiny):
    plan = check_section(tiny(), "gmm", section())
    assert plan["mode"] == "max" and plan["base"]["sweeps"] == 2 and plan["base"]["particles"] == 3
    assert plan["base"]["iterations"] == 120 and plan["base"]["network"] == {"hidden": 8}
    assert set(plan["space"]) == {"train.lr", "network.hidden"}
    # params.yaml's own settings are in the space: they are the search's first trial
    assert plan["reference"] == {"train.lr": 0.01, "network.hidden": 8}
    outside = check_section(tiny(), "gmm", section(space={"network.hidden": {"choice": [4, 16]}}))
    assert outside["reference"] is None


def test_searchers_and_schedulers_are_chosen_in_the_section(tiny):
    from pipeline.search.plan import plan_key
    from pipeline.search.stage import scheduler, searcher

    plan = check_section(
        tiny(), "gmm", section(search={"algorithm": "hyperopt", "seed": 3, "max_concurrent": 4})
    )
    made = searcher(plan)
    assert type(made.searcher).__name__ == "HyperOptSearch" and made.max_concurrent == 4
    assert type(scheduler(plan)).__name__ == "AsyncHyperBandScheduler"
    pbt = check_section(
        tiny(),
        "gmm",
        section(
            space={"train.lr": {"loguniform": [1e-4, 0.1]}},
            scheduler={"pbt": {"perturbation_interval": 20, "resample_probability": 0.5}},
        ),
    )
    assert pbt["pbt"] == {
        "perturbation_interval": 20,
        "quantile_fraction": 0.25,
        "resample_probability": 0.5,
        "synch": True,
    }
    made = scheduler(pbt)
    assert type(made).__name__ == "PopulationBasedTraining" and made._perturbation_interval == 20
    assert set(made._hyperparam_mutations) == {"train.lr"}
    fifo = check_section(tiny(), "gmm", section(scheduler={"fifo": {}}))
    assert type(scheduler(fifo)).__name__ == "FIFOScheduler" and "pbt" not in fifo
    # a section without PBT keeps the plan (and so the Ray experiment's name) it had before
    assert plan_key(check_section(tiny(), "gmm", section())) == "search-" + _KEY_BEFORE_PBT


_KEY_BEFORE_PBT = "66e7bc1275"  # plan_key of SECTION at the commit before PBT


def test_a_blocks_ess_is_a_score_to_maximize(tiny):
    assert check_section(tiny(), "gmm", section(metric="ess_c"))["mode"] == "max"


def test_report_lines_name_the_code_and_compare_with_the_defaults():
    from pipeline.search.report import defaults_line, made_at_line

    start = {"commit": "abc", "uncommitted": [], "started": "T0"}
    resumed = {"commit": "def", "uncommitted": ["pipeline/search/stage.py"], "started": "T1"}
    summary = {"starts": [start, resumed], "finished": "T2"}
    assert made_at_line(summary) == (
        "Run at commit `abc` (started T0); resumed at commit `def` with uncommitted changes to "
        "`pipeline/search/stage.py` (started T1); finished T2."
    )
    assert made_at_line({}) == "Made by code whose commit was not recorded."
    setting = {"train.lr": 0.01}
    ref = {"trial": "a", "setting": setting, "score": -10.0, "iterations": 40, "failed": False}
    summary = {
        "defaults": ref,
        "max_iterations": 120,
        "best": {"trial": "b", "score": -7.5, "iterations": 120},
    }
    line = defaults_line(summary)
    assert (
        "-10 after 40 iterations (stopped early); the best's score (after 120) differs from it by +2.5."
        in line
    )
    assert "(failed)" in defaults_line({**summary, "defaults": {**ref, "failed": True}})
    assert defaults_line({**summary, "best": {**summary["best"], "trial": "a"}}).endswith("ranked best.")


def test_scores_are_printed_to_the_digits_that_tell_settings_apart():
    from pipeline.search.report import _score_text

    assert _score_text(-274.9512) == "-274.95" and _score_text(0.992729) == "0.9927"
    assert _score_text(0.00523) == "0.00523" and _score_text(float("nan")) == "nan"


def test_the_best_trial_is_the_best_of_those_asha_trained_longest():
    import pandas as pd

    frame = pd.DataFrame(
        {"trial": list("abcd"), "iterations": [40, 120, 120, 80], "score": [-1.0, -5.0, -3.0, float("nan")]}
    )
    assert list(asha_order(frame, "max")["trial"]) == ["c", "b", "d", "a"]  # a scored best, but early
    assert list(asha_order(frame, "min")["trial"]) == ["b", "c", "d", "a"]


def test_method_options_are_the_searched_methods_own(tiny):
    params = tiny(**{"gmm.train.method_options": {"hmc-rws": {"step_size": 0.05}}})
    assert check_section(params, "gmm", section())["base"]["method_options"] == {}
    plan = check_section(params, "gmm", section(method="hmc-rws"))
    assert plan["base"]["method_options"] == {"step_size": 0.05}


def test_extremes_touch_every_bound_and_apply_sets_nested_keys():
    space = {
        "train.lr": ("loguniform", [1e-4, 1e-2]),
        "network.hidden": ("choice", [4, 8, 16]),
        "train.batch_size": ("randint", [2, 6]),
    }
    settings = extremes(space)
    assert {s["train.lr"] for s in settings} == {1e-4, 1e-2}
    assert {s["network.hidden"] for s in settings} == {4, 8, 16}
    assert {s["train.batch_size"] for s in settings} == {2, 5}  # randint's high is exclusive
    cfg = apply_setting(
        {"lr": 1.0, "network": {"hidden": 8, "other": 1}}, {"train.lr": 0.5, "network.hidden": 4}
    )
    assert cfg == {"lr": 0.5, "network": {"hidden": 4, "other": 1}}


@pytest.mark.parametrize(
    "space, expected",
    [
        ({"optim.lr": {"uniform": [0.1, 0.2]}}, "keys are <section>.<name>"),
        ({"train.lrr": {"uniform": [0.1, 0.2]}}, "unknown training option"),
        ({"network.width": {"choice": [4, 8]}}, "width"),
        ({"train.lr": {"uniform": [-1.0e-3, 1.0e-2]}}, "lr must be a positive number"),
        ({"train.lr": {"loguniform": [0, 1.0e-2]}}, "loguniform needs 0 < low"),
        ({"train.lr": {"uniform": [0.2, 0.1]}}, "low < high"),
        ({"train.lr": {"normal": [0.1, 0.2]}}, "unknown distribution"),
        ({"network.hidden": {"choice": []}}, "non-empty list"),
        ({"train.batch_size": {"randint": [1.5, 4]}}, "integer bounds"),
        ({}, "at least one key"),
    ],
)
def test_bad_search_spaces_are_one_line_errors(space, expected, tiny):
    with pytest.raises(ParamsError, match=expected) as err:
        check_section(tiny(), "gmm", section(space=space))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"metric": "accuracy"}, "metric"),
        ({"metric": "mse"}, "does not reconstruct"),
        ({"metric": "ess_mu"}, r"a block's ESS is one of \['ess_globals', 'ess_c'\]"),
        ({"metric": "ess_c", "pair": [1, 3]}, "ess_c needs block updates: method apg at K=1 has none"),
        ({"metric": "ess_c", "method": "rws-mlp"}, "method rws-mlp at K=2 has none"),
        ({"metric": 5}, "or ess_<block>, got 5"),
        ({"pair": [2]}, "pair"),
        ({"scheduler": {"hyperband": {}}}, "scheduler"),
        ({"scheduler": {"asha": {"grace_period": 500}}}, "grace_period"),
        ({"search": {"algorithm": "grid"}}, "algorithm"),
        ({"search": {"algorithm": "optuna", "max_concurrent": 0}}, "max_concurrent: a positive integer"),
        (
            {"search": {"algorithm": "optuna", "concurrency": 4}},
            r"search: unknown key\(s\) \['concurrency'\]",
        ),
        ({"validation": {"num_datasets": 4, "seed": 2}}, "seed of the training or a test set"),
        # PBT moves weights between trials: nothing that shapes the networks may differ
        (
            {"scheduler": {"pbt": {"perturbation_interval": 20}}},
            r"train.\* keys only, not \['network.hidden'\]",
        ),
        (
            {
                "scheduler": {"pbt": {}},
                "space": {"train.lr": {"loguniform": [1e-4, 0.1]}},
                "search": {"algorithm": "optuna"},
            },
            "PBT draws its population at random",
        ),
        (
            {
                "scheduler": {"pbt": {"perturbation_interval": 15}},
                "space": {"train.lr": {"loguniform": [1e-4, 0.1]}},
            },
            "perturbation_interval: a multiple of eval_every=10 below iterations=120, got 15",
        ),
        (
            {
                "scheduler": {"pbt": {"quantile_fraction": 0.9}},
                "space": {"train.lr": {"loguniform": [1e-4, 0.1]}},
            },
            r"quantile_fraction: a number in \(0, 0.5\]",
        ),
        ({"scheduler": {"pbt": {"every": 10}}}, "a mapping of perturbation_interval"),
        ({"budget": 3}, "unknown key"),
    ],
)
def test_bad_sections_are_one_line_errors(changes, expected, tiny):
    with pytest.raises(ParamsError, match=expected):
        check_section(tiny(), "gmm", section(**changes))


def test_cli_rejects_a_bad_space_before_anything_starts(tmp_path, monkeypatch, capsys, tiny):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny()))
    (tmp_path / "tune.yaml").write_text(
        yaml.safe_dump({"gmm": section(space={"train.lr": {"loguniform": [0.0, 0.1]}})})
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as code:
        main(["--task", "gmm"])
    assert code.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "loguniform needs 0 < low" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "tune.yaml"]  # nothing written


def test_token_auth_is_left_alone_when_attached_to_a_cluster(tmp_path, monkeypatch, capsys, tiny):
    # Only the embedded loopback instance runs without Ray's token auth; a search attached
    # to a cluster (here one that is not there) must not switch it off for the user.
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny()))
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({"gmm": section()}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    with pytest.raises(SystemExit) as code:
        main(["--task", "gmm"])
    assert code.value.code == 2  # no training data here: the search stops before Ray starts
    assert "RAY_AUTH_MODE" not in os.environ


def test_a_tuning_file_with_a_key_given_twice_is_refused(tmp_path, monkeypatch, capsys, tiny):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny()))
    (tmp_path / "tune.yaml").write_text("gmm: {}\ngmm: {}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as code:
        main(["--task", "gmm"])
    assert code.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "key 'gmm' given twice" in err[0]


def test_a_baseline_search_is_named_for_its_method_and_writes_nothing_without_data(
    tmp_path, monkeypatch, capsys, tiny
):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny()))
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({"gmm": section(metric="log_joint")}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as code:
        main(["--task", "gmm", "--method", "rws-mlp"])
    assert code.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run `dvc repro generate@gmm` first" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "params.yaml",
        "tune.yaml",
    ]  # no validation set left


def test_the_report_goes_to_a_file_when_one_is_named():
    from pipeline.search.report import report_path

    assert report_path("reports/tune", "dgmm-rws-mlp") == Path("reports/tune/dgmm-rws-mlp.md")
    assert report_path("elsewhere/search.md", "gmm") == Path("elsewhere/search.md")


def test_best_params_carry_the_iterations_the_trials_ran(tiny):
    from pipeline.search.report import best_params

    params = tiny()
    plan = check_section(params, "gmm", section(iterations=600))
    plan.update(command="apg-pipeline tune --task gmm --method rws-mlp", source="my-tune.yaml")
    text = best_params(params, plan, {"train.lr": 0.01}, -280.0)
    written = yaml.safe_load(text)["gmm"]["train"]
    assert written["iterations"] == 600 and written["lr"] == 0.01
    assert "--method rws-mlp" in text.splitlines()[0] and "(my-tune.yaml)" in text.splitlines()[0]


def _trial_dirs(root: Path) -> list[Path]:
    return sorted((root / "results" / "tune" / "gmm" / "ray").glob("search-*/run_trial_*"))


@pytest.mark.slow
def test_search_stops_trials_early_and_resumes_after_an_interruption(tmp_path, tiny):
    from ray.tune import ExperimentAnalysis

    root = make_repo(tmp_path, tiny())
    (root / "tune.yaml").write_text(yaml.safe_dump({"gmm": section()}))
    subprocess.run(
        [sys.executable, "-m", "pipeline.generate", "--task", "gmm"], cwd=root, env=env(), check=True
    )
    cmd = [sys.executable, "-m", "pipeline.search.stage", "--task", "gmm"]
    proc = subprocess.Popen(
        cmd, cwd=root, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # Interrupt once a trial has reported twice: trials are then mid-way. Tune keeps only
        # a trial's last checkpoint, and a tiny trial reports several times between two polls,
        # so look for any checkpoint past the first, not for the second one by name.
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if any(d.name != "checkpoint_000000" for t in _trial_dirs(root) for d in t.glob("checkpoint_*")):
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, out[-2000:] + err[-2000:]
    assert "interrupted" in err and "run the same command again to resume" in err
    assert not (root / "results" / "tune" / "gmm" / "best-params.yaml").exists()
    experiment = next((root / "results" / "tune" / "gmm" / "ray").glob("search-*"))
    trials_before = ExperimentAnalysis(str(experiment)).trials
    before = {t.trial_id: t.status for t in trials_before}
    assert any(status != "TERMINATED" for status in before.values()), before
    checkpointed = {}  # each trial's last validation checkpoint at the interruption
    for t in trials_before:
        saved = sorted(Path(t.path).glob("checkpoint_*/resume.pt"))
        checkpointed[t.trial_id] = load_checkpoint(saved[-1])[1]["trainer"]["iteration"] if saved else 0

    proc = subprocess.run(cmd, cwd=root, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = root / "results" / "tune" / "gmm"
    trials = {p.stem: read_attempts(out, p.stem) for p in (out / "attempts").glob("*.jsonl")}
    assert len(trials) == SECTION["search"]["num_samples"]
    for trial_id, attempts in trials.items():
        assert attempts[0]["start_iteration"] == 0
        if before.get(trial_id) == "TERMINATED":  # ended before the interruption: not run again
            assert len(attempts) == 1, (trial_id, attempts)
        elif len(attempts) > 1:
            # resumed from a validation checkpoint, not from scratch: the last one the search
            # had recorded when it stopped, which can be one report behind the trial's own
            # last (a report in flight at Ctrl+C); so at most eval_every steps run twice
            (resumed,) = [a["start_iteration"] for a in attempts[1:]]
            every = SECTION["eval_every"]
            assert (
                resumed % every == 0 and checkpointed[trial_id] - every <= resumed <= checkpointed[trial_id]
            ), (trial_id, attempts, checkpointed[trial_id])
    assert any(len(a) > 1 and a[1]["start_iteration"] > 0 for a in trials.values()), (
        trials,
        before,
        checkpointed,
    )

    import pandas as pd

    frame = pd.read_csv(root / "results" / "tune" / "gmm" / "trials.csv")
    assert len(frame) == 6 and frame["stopped_early"].sum() >= 1, frame
    assert (frame.loc[frame["stopped_early"], "iterations"] < 120).all()
    summary = json.loads((root / "results" / "tune" / "gmm" / "summary.json").read_text())
    best = yaml.safe_load((root / "results" / "tune" / "gmm" / "best-params.yaml").read_text())
    assert best["gmm"]["train"]["lr"] == pytest.approx(summary["best"]["setting"]["train.lr"])
    assert best["gmm"]["network"]["hidden"] == summary["best"]["setting"]["network.hidden"]
    assert frame.iloc[0]["score"] == pytest.approx(summary["best"]["score"])
    # params.yaml's settings (lr 0.01, hidden 8) ran as one trial and the report says how they did
    mine = frame[frame["defaults"]]
    assert len(mine) == 1 and mine.iloc[0]["train.lr"] == pytest.approx(0.01)
    assert summary["defaults"]["trial"] == mine.iloc[0]["trial"]
    assert "params.yaml's own settings" in (root / "reports" / "tune" / "gmm.md").read_text()
    report = (root / "reports" / "tune" / "gmm.md").read_text()
    assert "stopped early" in report and (root / "reports" / "tune" / "gmm.png").is_file()
    # the report names the code it measured: the throwaway repo's one commit, nothing uncommitted
    head = subprocess.run(
        ["git", "rev-parse", "--short=10", "HEAD"], cwd=root, capture_output=True, text=True
    )
    assert f"Run at commit `{head.stdout.strip()}` (started " in report and "; resumed at commit" in report

    # MLflow: one parent, one child run per trial across the interruption, the best tagged
    _, runs = mlflow_runs(root, "apg-test-tune")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [p.info.run_name for p in parents] == ["tune gmm"]
    client, _ = mlflow_runs(root, "apg-test-tune")
    kind = client.get_experiment_by_name("apg-test-tune").tags.get("mlflow.experimentKind")
    assert kind == "custom_model_development"  # opens in the runs table, not the GenAI view
    assert sorted(r.data.tags[TAG_TRIAL] for r in children) == sorted(trials)
    assert all(set(r.data.params) == {"train.lr", "network.hidden"} for r in children)
    # each trial logged its rows from the trial, as a sweep's cell does: training metrics and
    # the validation score, and the nodes it ran on
    assert all(
        {"loss", "val_log_joint"} <= set(r.data.metrics) and "apg.nodes" in r.data.tags for r in children
    )
    tagged = [r for r in children if r.data.tags.get(TAG_BEST) == "true"]
    assert [r.data.tags[TAG_TRIAL] for r in tagged] == [summary["best"]["trial"]]
    assert all(r.info.status == "FINISHED" for r in runs)

    # Run again from scratch (Ray's storage deleted): new trials under a new parent, the
    # earlier parent kept with its trials and marked superseded (its best params stay as logged)
    shutil.rmtree(root / "results" / "tune" / "gmm" / "ray")
    proc = subprocess.run(cmd, cwd=root, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, runs = mlflow_runs(root, "apg-test-tune")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2 and len(runs) == 2 + 2 * SECTION["search"]["num_samples"]
    keys = sorted(p.data.tags["apg.sweep_key"] for p in parents)
    new = next(p for p in parents if p.data.tags["apg.sweep_key"] == keys[0])
    under_new = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == new.info.run_id]
    assert len(under_new) == SECTION["search"]["num_samples"]  # the new trials, none of the old
    assert keys[1] == keys[0] + "@superseded-" + next(
        p.info.run_id[:8] for p in parents if p.data.tags["apg.sweep_key"] != keys[0]
    )


def test_the_report_draws_a_choice_as_categories_and_goes_where_asked(tmp_path, tiny):
    from pipeline.search.report import write_report

    plan = check_section(tiny(), "gmm", section())
    plan.update(
        command="apg-pipeline tune --task gmm --method rws-mlp",
        source="tune.yaml",
        best_file="x/best-params.yaml",
    )
    rows = [
        {
            "trial": f"t{i}",
            "train.lr": lr,
            "network.hidden": hidden,
            "score": score,
            "best_score": score,
            "iterations": 120,
            "stopped_early": early,
            "defaults": i == 0,
            "attempts": 1,
            "history": json.dumps([[60, score - 1], [120, score]]),
        }
        for i, (lr, hidden, score, early) in enumerate(
            [(0.01, 8, -10.0, False), (0.001, 4, -12.0, True), (0.05, 8, -9.0, False)]
        )
    ]
    out = tmp_path / "out"
    out.mkdir()
    import pandas as pd

    pd.DataFrame(rows).to_csv(out / "trials.csv", index=False)
    best = {
        "trial": "t2",
        "setting": {"train.lr": 0.05, "network.hidden": 8},
        "score": -9.0,
        "iterations": 120,
    }
    summary = {
        "best": best,
        "trials": 3,
        "stopped_early": 1,
        "failed": 0,
        "max_iterations": 120,
        "finished": "now",
        "defaults": {
            "trial": "t0",
            "setting": {"train.lr": 0.01, "network.hidden": 8},
            "score": -10.0,
            "iterations": 120,
        },
    }
    (out / "summary.json").write_text(json.dumps(summary))
    path = write_report(plan, out, tmp_path / "elsewhere" / "search.md")
    assert path == tmp_path / "elsewhere" / "search.md" and (tmp_path / "elsewhere" / "search.png").is_file()
    text = path.read_text()
    assert "`apg-pipeline tune --task gmm --method rws-mlp`" in text and "`x/best-params.yaml`" in text
    assert "the highest score among" in text
    plan["mode"] = "min"  # a score to lower (mse): the best is the lowest
    assert "the lowest score among" in write_report(plan, out, tmp_path / "min.md").read_text()


@pytest.mark.slow
def test_pbt_moves_weights_and_rates_between_trials(tmp_path, tiny):
    from ray.tune import ExperimentAnalysis

    root = make_repo(tmp_path, tiny())
    pbt = section(
        iterations=60,
        space={"train.lr": {"loguniform": [1.0e-6, 0.1]}},  # some rates too small to learn at all
        search={"algorithm": "random", "num_samples": 4, "seed": 1},
        scheduler={
            "pbt": {"perturbation_interval": 20, "quantile_fraction": 0.5, "resample_probability": 0.5}
        },
    )
    (root / "tune.yaml").write_text(yaml.safe_dump({"gmm": pbt}))
    run([sys.executable, "-m", "pipeline.generate", "--task", "gmm"], root)
    proc = run([sys.executable, "-m", "pipeline.search.stage", "--task", "gmm"], root)
    out = root / "results" / "tune" / "gmm"
    experiment = next((out / "ray").glob("search-*"))
    # Tune's PBT log: one line per exploit, [target tag, clone tag, target iter, clone iter, ...]
    exploits = [json.loads(line) for line in (experiment / "pbt_global.txt").read_text().splitlines()]
    assert exploits, proc.stdout[-2000:]
    trials = {t.trial_id: t for t in ExperimentAnalysis(str(experiment)).trials}
    attempts = {p.stem: read_attempts(out, p.stem) for p in (out / "attempts").glob("*.jsonl")}
    # an exploited trial restarted from the donor's checkpoint, mid-way, not from scratch
    restarts = [a["start_iteration"] for runs in attempts.values() for a in runs[1:]]
    assert restarts and all(r > 0 and r % 20 == 0 for r in restarts), attempts
    import pandas as pd

    frame = pd.read_csv(out / "trials.csv", dtype={"trial": str}).set_index("trial")
    # Tune's PBT now and then ends a trial before its last iteration, with neither an error
    # nor "done" (seen here with synch on; ray-project/ray#11906): the table says where each
    # trial's training ended, as Tune last recorded it, and marks the early ends.
    last = {key: t.last_result["iteration"] for key, t in trials.items()}
    assert len(frame) == 4 and frame["iterations"].to_dict() == last, (frame, last)
    assert (frame["stopped_early"] == (frame["iterations"] < 60)).all() and not frame["failed"].any(), frame
    assert (frame["iterations"] == 60).any(), frame
    # the report says what PBT did; MLflow keeps each trial's first rate and tags its last
    assert "PBT (every 20 iterations" in (root / "reports" / "tune" / "gmm.md").read_text()
    _, runs = mlflow_runs(root, "apg-test-tune")
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    final = {r.data.tags[TAG_TRIAL]: float(r.data.tags["final.train.lr"]) for r in children}
    assert final == pytest.approx({k: t.config["train.lr"] for k, t in trials.items()})
    moved = [r for r in children if float(r.data.params["train.lr"]) != float(r.data.tags["final.train.lr"])]
    assert moved, [(r.data.params, r.data.tags) for r in children]


@pytest.mark.slow
def test_the_search_to_try_runs_as_the_readme_gives_it(tmp_path):
    # tuning/try.yaml on the project's own params.yaml, by the command its header gives.
    repo = REPO
    root = make_repo(tmp_path, yaml.safe_load((repo / "params.yaml").read_text()))
    (root / "tuning").mkdir()
    shutil.copy(repo / "tuning" / "try.yaml", root / "tuning" / "try.yaml")
    header = (root / "tuning" / "try.yaml").read_text()
    command = (
        next(line for line in header.splitlines() if "apg-pipeline tune" in line).split("#", 1)[1].split()
    )
    assert command[:2] == ["apg-pipeline", "tune"]
    run([sys.executable, "-m", "pipeline.generate", "--task", "gmm"], root)
    proc = run([sys.executable, "-m", "pipeline.search.stage", *command[2:]], root)
    out = root / "results" / "tune" / "try"
    assert (out / "best-params.yaml").is_file() and (out / "gmm.md").is_file(), proc.stdout[-2000:]
    import pandas as pd

    frame = pd.read_csv(out / "trials.csv")
    assert len(frame) == 6 and frame["score"].notna().all() and frame["stopped_early"].any()
    assert "hyperopt search over 6 trials, ASHA" in (out / "gmm.md").read_text()
    assert not (root / "reports" / "tune").exists()  # nothing written where the committed reports live
    # Quiet by default: a line a finished trial, and at most 40 others (--verbose: Tune's tables).
    lines = (proc.stdout + proc.stderr).splitlines()
    progress = [line for line in lines if " trials done" in line]
    assert len(progress) == 6 and progress[-1].startswith("tune gmm: 6/6 trials done, best ")
    assert len(lines) - len(progress) <= 40, "\n".join(lines)


SEEDED = {
    "space": {"train.lr": {"grid": [1.0e-6, 0.01]}},
    "search": {"algorithm": "random", "num_samples": 1, "seed": 0},
    "scheduler": {"fifo": {}},
    "seeds": [0, 1, 2],
}


def test_a_search_with_seeds_trains_each_grid_setting_with_each_seed(tiny):
    from pipeline.search.plan import plan_key

    plan = check_section(tiny(), "gmm", section(**SEEDED))
    assert plan["seeds"] == [0, 1, 2] and plan["space"] == {"train.lr": ("grid", [1.0e-6, 0.01])}
    assert plan["reference"] == {"train.lr": 0.01}  # params.yaml's rate is on the grid
    assert extremes(plan["space"]) == [{"train.lr": 1.0e-6}, {"train.lr": 0.01}]
    # a section without seeds keeps the plan (and so the Ray experiment's name) it had before
    assert "seeds" not in check_section(tiny(), "gmm", section())
    assert plan_key(check_section(tiny(), "gmm", section())) == "search-" + _KEY_BEFORE_PBT


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"seeds": [0, 0]}, "seeds: a list of distinct non-negative integers"),
        ({"seeds": []}, "seeds: a list of distinct non-negative integers"),
        (
            {"space": {"train.lr": {"loguniform": [1e-4, 0.1]}}},
            "give the space as grids and the random searcher",
        ),
        ({"scheduler": {"asha": {}}}, "each seed trains to the end: scheduler {fifo: {}}"),
        ({"search": {"algorithm": "random", "num_samples": 2}}, "search.num_samples: 1 with seeds"),
        ({"search": {"algorithm": "optuna"}}, "a grid (train.lr) needs the random searcher"),
        ({"space": {"train.lr": {"grid": []}}}, "grid needs a non-empty list of values"),
    ],
)
def test_bad_seeded_sections_are_one_line_errors(changes, expected, tiny):
    with pytest.raises(ParamsError, match=re.escape(expected)):
        check_section(tiny(), "gmm", section(**{**SEEDED, **changes}))


def test_a_setting_ranks_by_its_mean_over_seeds_and_needs_every_seed():
    import pandas as pd

    from pipeline.search.report import settings_frame

    plan = {
        "space": {"train.lr": ("grid", [0.1, 0.01, 0.001])},
        "seeds": [0, 1],
        "iterations": 100,
        "mode": "max",
    }
    frame = pd.DataFrame(
        {
            "trial": list("abcdef"),
            "train.lr": [0.1, 0.1, 0.01, 0.01, 0.001, 0.001],
            "seed": [0, 1, 0, 1, 0, 1],
            "defaults": [False, False, True, True, False, False],
            # 0.1: best seed of all, one stall; 0.01: steady; 0.001: one seed never finished
            "score": [-10.0, -900.0, -50.0, -60.0, -1.0, float("nan")],
            "iterations": [100, 100, 100, 100, 100, 40],
            "failed": [False, False, False, False, False, True],
        }
    )
    ranked = settings_frame(plan, frame)
    assert list(ranked["train.lr"]) == [0.01, 0.1, 0.001]
    assert list(ranked["complete"]) == [True, True, False]
    assert ranked.loc[0, "mean"] == -55.0 and ranked.loc[1, "lowest"] == -900.0
    assert json.loads(ranked.loc[0, "per_seed"]) == {"0": -50.0, "1": -60.0}
    assert ranked.loc[0, "trials"] == "c d" and bool(ranked.loc[0, "defaults"])


@pytest.mark.slow
def test_a_search_with_seeds_runs_every_setting_with_every_seed(tmp_path, tiny):
    root = make_repo(tmp_path, tiny())
    seeded = section(iterations=20, **SEEDED, eval_every=10)
    seeded["seeds"] = [0, 1]
    (root / "tune.yaml").write_text(yaml.safe_dump({"gmm": seeded}))
    run([sys.executable, "-m", "pipeline.generate", "--task", "gmm"], root)
    proc = run([sys.executable, "-m", "pipeline.search.stage", "--task", "gmm"], root)
    assert "tune gmm: 4/4 trials done" in proc.stdout, proc.stdout[-2000:]
    out = root / "results" / "tune" / "gmm"
    import pandas as pd

    trials = pd.read_csv(out / "trials.csv")
    assert sorted(zip(trials["train.lr"], trials["seed"], strict=True)) == [
        (1e-6, 0),
        (1e-6, 1),
        (0.01, 0),
        (0.01, 1),
    ]
    assert (trials["iterations"] == 20).all() and not trials["failed"].any()
    # each seed trained its own network: the same setting scores differently per seed
    for _, part in trials.groupby("train.lr"):
        assert part["score"].nunique() == 2, trials
    summary = json.loads((out / "summary.json").read_text())
    settings = pd.read_csv(out / "settings.csv")
    best = settings.iloc[0]
    assert summary["best"]["setting"] == {"train.lr": best["train.lr"]}
    mean = trials[trials["train.lr"] == best["train.lr"]]["score"].mean()
    assert summary["best"]["score"] == pytest.approx(mean)
    assert summary["defaults"]["setting"] == {"train.lr": 0.01}
    text = (root / "reports" / "tune" / "gmm.md").read_text()
    assert "mean over the seeds 0, 1" in text and "Each setting over the seeds" in text
    assert "random search over 4 trials" in text
    assert "(lr=0.01, trials `" in text and "their mean)" in text  # params.yaml's rate, over its seeds
    _, runs = mlflow_runs(root, "apg-test-tune")
    tagged = {r.data.params["train.seed"] for r in runs if r.data.tags.get(TAG_BEST) == "true"}
    assert tagged == {"0", "1"}  # both seeds' runs of the best setting
