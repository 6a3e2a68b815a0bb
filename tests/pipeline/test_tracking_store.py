"""The local MLflow store (``mlflow.db``) is made whole or not at all: a disk that fills
while it is made leaves nothing the next run trips on, and a store found half-made is
rebuilt when it holds no runs (pipeline/tracking.py ``prepare_store``)."""

from __future__ import annotations

import errno
import shutil
import sqlite3

import pytest

from pipeline import tracking


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A store made by ``prepare_store`` (a real MLflow migration: seconds)."""
    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    tracking.prepare_store(f"sqlite:///{path}")
    return path


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch):
    monkeypatch.setattr(tracking, "_PREPARED", set())


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name not in ("mlflow.db", ".mlflow.db.lock"))


def test_a_made_store_is_whole_and_left_alone(made):
    assert tracking.store_problem(made) == (None, 0)
    assert [e.name for e in tracking.client(f"sqlite:///{made}").search_experiments()] == ["Default"]
    assert leftovers(made.parent) == []  # no temporary file left beside it


def test_a_disk_full_while_making_leaves_no_store_and_the_next_run_makes_it(tmp_path, monkeypatch):
    import mlflow.store.db.utils as db_utils

    path = tmp_path / "mlflow.db"
    real = db_utils._upgrade_db

    def disk_fills(engine):  # the tables exist, the migrations never finish
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(db_utils, "_upgrade_db", disk_fills)
    with pytest.raises(OSError) as err:  # the one line of a full disk (pipeline.errors), naming the store
        tracking.prepare_store(f"sqlite:///{path}")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert not path.exists() and leftovers(tmp_path) == []  # nothing half-made under the name
    monkeypatch.setattr(db_utils, "_upgrade_db", real)
    tracking.prepare_store(f"sqlite:///{path}")  # the next run: no hand step
    assert tracking.store_problem(path) == (None, 0)
    client = tracking.client(f"sqlite:///{path}")
    exp = tracking.experiment_id(client, "apg", None)
    assert client.create_run(exp).info.run_id


def copy(made, tmp_path):
    path = tmp_path / "mlflow.db"
    shutil.copy(made, path)
    return path


def make_by_copy(made, monkeypatch):
    """Rebuilds made by copying the module's store (the making itself is tested above)."""

    def make(path):
        tmp = path.with_name(f".{path.name}.1.tmp")
        shutil.copy(made, tmp)
        tmp.replace(path)

    monkeypatch.setattr(tracking, "_make_store", make)


def test_a_leftover_alembic_table_with_no_runs_is_rebuilt(made, tmp_path, monkeypatch, capsys):
    path = copy(made, tmp_path)
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE _alembic_tmp_jobs (id INTEGER)")
    assert tracking.store_problem(path) == ("half-migrated (leftover _alembic_tmp_jobs)", 0)
    make_by_copy(made, monkeypatch)
    tracking.prepare_store(f"sqlite:///{path}")
    assert tracking.store_problem(path) == (None, 0)
    assert "was half-migrated (leftover _alembic_tmp_jobs) with no runs; made anew" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [0, 4096])
def test_a_truncated_or_empty_store_is_kept_aside_and_made_anew(made, tmp_path, monkeypatch, capsys, keep):
    path = copy(made, tmp_path)
    with open(path, "r+b") as f:
        f.truncate(keep)
    problem, runs = tracking.store_problem(path)
    assert problem is not None and runs in (0, None), (problem, runs)
    make_by_copy(made, monkeypatch)
    tracking.prepare_store(f"sqlite:///{path}")
    assert tracking.store_problem(path) == (None, 0)
    aside = [name for name in leftovers(tmp_path) if name.startswith("mlflow.db.broken-")]
    assert len(aside) == (1 if runs is None else 0), leftovers(tmp_path)
    assert "made anew" in capsys.readouterr().err


def test_a_half_migrated_store_that_holds_runs_is_left_alone_with_one_line(made, tmp_path, monkeypatch):
    path = copy(made, tmp_path)
    client = tracking.client(f"sqlite:///{path}")
    client.create_run(tracking.experiment_id(client, "apg", None))
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE _alembic_tmp_jobs (id INTEGER)")
    before = path.read_bytes()
    monkeypatch.setattr(tracking, "_PREPARED", set())
    with pytest.raises(
        tracking.TrackingError, match=r"is half-migrated .* and holds 1 runs: back it up, then run"
    ):
        tracking.prepare_store(f"sqlite:///{path}")
    assert path.read_bytes() == before


def test_a_server_uri_is_not_touched(tmp_path):
    tracking.prepare_store("http://127.0.0.1:1")  # nothing to do, nothing raised
    tracking.prepare_store("sqlite:///:memory:")


def test_runs_made_in_a_sandbox_name_the_projects_commit(monkeypatch):
    """Smoke and recorded profiles run the stages in a sandbox repo with a commit of its own:
    their runs name the project's commit (APG_COMMIT, set by ``sandbox_env``) instead."""
    import subprocess

    from pipeline import tracking
    from pipeline.smoke import sandbox_env
    from tests.support import REPO

    monkeypatch.delenv("APG_COMMIT", raising=False)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    env = sandbox_env()
    assert env["APG_COMMIT"] == head and "MLFLOW_TRACKING_URI" not in env
    monkeypatch.setenv("APG_COMMIT", "abc123")
    assert tracking.source_tags(REPO, "smoke", {})["mlflow.source.git.commit"] == "abc123"


def test_runs_url_prints_the_experiments_runs_table_and_adds_its_view(tmp_path, monkeypatch, capsys):
    """``apg-pipeline runs-url``: the address of the experiment's saved view of its runs (the
    headline columns), which an experiment made before there was one is given; no store or
    no such experiment: one line."""
    import json

    from pipeline import cli
    from tests.support import REPO

    monkeypatch.setenv("APG_PROJECT_ROOT", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = ["runs-url", "--params", str(REPO / "params.yaml")]

    def run(*extra: str) -> tuple[int, str, str]:
        try:
            cli.main([*args, *extra])
            code = 0
        except SystemExit as stop:
            code = stop.code
        out, err = capsys.readouterr()
        return code, out, err

    code, _, err = run()
    assert code == 2 and f"no MLflow store at {tmp_path / 'mlflow.db'}" in err
    client = tracking.client(tracking.tracking_uri(tmp_path))
    exp_id = client.create_experiment("apg")  # as a sweep made it before the view
    code, out, err = run()
    assert (code, out) == (0, tracking.ui_url(tracking.LOCAL_UI, exp_id) + "\n")
    assert "mlflow ui --backend-store-uri sqlite:///" in err
    tags = client.get_experiment(exp_id).tags
    assert {k: tags.get(k) for k in tracking.EXPERIMENT_TAGS} == tracking.EXPERIMENT_TAGS
    view = json.loads(json.loads(tags[f"mlflow.sharedViewState.{tracking.RUNS_VIEW}"])["state"])
    assert view["selectedColumns"] == tracking.HEADLINE_COLUMNS
    assert run("--ui", "http://host:8080")[1] == tracking.ui_url("http://host:8080", exp_id) + "\n"
    code, out, err = run("--experiment", "nope")
    assert code == 2 and not out and "has no experiment 'nope'" in err
