"""Profiles as overlays of ``params.yaml`` (``pipeline.config.profiles``): the merge rules, every
profile resolving to valid params, check variants that are their profile under
``paper-check``'s caps, and ``apg-pipeline config``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from pipeline.config import profiles
from pipeline.config.params import ParamsError, grid_cells, validate_params
from pipeline.recorded.record import CHECK_ITERATIONS, CHECK_PROFILE
from tests.support import REPO

NAMES = profiles.profile_names()
CHECKED = sorted(p.stem for p in (REPO / "profiles" / "check").glob("*.yaml"))


def overlay(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "overlay.yaml"
    path.write_text(text)
    return profiles.read_overlay(path)


def test_mappings_merge_key_by_key_and_other_values_replace(tmp_path):
    base = {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "l": [1, 2, 3], "n": 5, "z": None}
    frozen = copy.deepcopy(base)
    out = profiles.merge(base, overlay(tmp_path, "a: {c: {e: 4}}\nl: [9]\nn: null\nz: 0\n"))
    assert out == {"a": {"b": 1, "c": {"d": 2, "e": 4}}, "l": [9], "n": None, "z": 0}
    assert list(out) == list(base)  # the base's key order
    assert base == frozen  # neither input is changed


def test_delete_removes_a_key_and_replace_sets_a_mapping_whole(tmp_path):
    base = {"a": {"b": 1, "c": 2}, "d": {"e": 1}}
    out = profiles.merge(base, overlay(tmp_path, "a: {b: !delete ''}\nd: !replace {f: 2}\n"))
    assert out == {"a": {"c": 2}, "d": {"f": 2}}
    assert type(out["d"]) is dict  # plain data: yaml.safe_dump can write it
    block = "a:\n  b: !delete\nd: !replace\n  f: 2\n"
    assert profiles.merge(base, overlay(tmp_path, block)) == out


@pytest.mark.parametrize(
    ("text", "where"),
    [("a: {x: 1}\n", "a.x"), ("a: {x: !delete ''}\n", "a.x"), ("q: 1\n", "q")],
)
def test_a_key_the_base_lacks_is_an_error_not_a_silent_addition(tmp_path, text, where):
    with pytest.raises(ParamsError, match=rf"^{where}: the overlay (sets|deletes) a key .* !replace"):
        profiles.merge({"a": {"b": 1}}, overlay(tmp_path, text))


def test_an_overlay_key_given_twice_is_refused(tmp_path):
    with pytest.raises(ParamsError, match="given twice"):
        overlay(tmp_path, "a: 1\na: 2\n")


@pytest.mark.parametrize("name", NAMES)
def test_every_profile_resolves_to_valid_params_with_no_markers_left(name):
    params = profiles.resolve(name)
    validate_params(params)
    assert yaml.safe_load(profiles.dump(params)) == params  # plain YAML data, written and read back
    assert all(grid_cells(params, task) for task in params["tasks"])


def test_the_profiles_are_the_papers_the_smoke_runs_and_the_recorded_ones():
    assert {"smoke", "paper", "paper-gmm", "paper-check", "gpu-bmnist", "replicate"} <= set(NAMES)
    assert profiles.extends("smoke") == profiles.extends("paper") == "params.yaml"
    assert set(CHECKED) == set(NAMES) - {"smoke", "paper", CHECK_PROFILE}


def test_the_paper_profile_keeps_params_yamls_structure_at_the_papers_sizes():
    base, paper = profiles.load(REPO / "params.yaml"), profiles.resolve("paper")
    assert paper["tasks"] == base["tasks"]
    for task in base["tasks"]:
        assert set(paper[task]) == set(base[task])
        assert set(paper[task]["train"]) <= set(base[task]["train"])
        assert paper[task]["train"]["iterations"] == 200_000 and "lr_schedule" not in paper[task]["train"]
    assert {c.sweeps * c.particles for c in grid_cells(paper, "gmm") if c.method == "apg"} == {100, 1000}


def caps(params: dict, every_set: bool = False) -> dict:
    """``paper-check``'s caps as a rule (the specification the check overlays are held to):
    CHECK_ITERATIONS steps, one batch of datasets per set (two per figure set), one seed, one
    trial per core, a checkpoint and a report every step; of the held-out sets, the first and
    the one an imputation names (``every_set``: all of them, as paper-check keeps)."""
    params = copy.deepcopy(params)
    for task in params["tasks"]:
        section = params[task]
        train_batch, eval_batch = section["train"]["batch_size"], section["evaluate"]["batch_size"]
        section["train"]["iterations"] = min(section["train"]["iterations"], CHECK_ITERATIONS)
        data = section["data"]
        data["train"]["num_datasets"] = min(data["train"]["num_datasets"], train_batch)
        for key in ("test", "tests", "figures"):
            entries = data.get(key)
            for entry in entries if isinstance(entries, list) else [entries] if entries else []:
                entry["num_datasets"] = min(entry["num_datasets"], eval_batch if key != "figures" else 2)
        for entry in section["grid"]:
            entry["seeds"] = entry["seeds"][:1]
            if "iterations" in entry.get("train", {}):
                entry["train"]["iterations"] = min(entry["train"]["iterations"], CHECK_ITERATIONS)
        if data.get("tests") and not every_set:
            imputed = (section["evaluate"].get("imputation") or {}).get("test_set")
            data["tests"] = [t for i, t in enumerate(data["tests"]) if i == 0 or t["name"] == imputed]
    params["sweep"].update(
        cpus_per_trial=1, torch_threads=1, gpus_per_trial=0, num_cpus=None, checkpoint_every=1, log_every=1
    )
    params["tracking"]["experiment"] = "apg-paper-check"
    params["report"]["scale"] = (
        f"paper per-step sizes, {CHECK_ITERATIONS} training steps (a check, not results)"
    )
    return params


@pytest.mark.parametrize("name", CHECKED)
def test_a_check_variant_is_its_profile_under_paper_checks_caps(name):
    assert profiles.resolve(name, check=True) == caps(profiles.resolve(name))


def test_paper_check_is_the_paper_under_the_caps_with_every_held_out_set():
    assert profiles.resolve(CHECK_PROFILE) == caps(profiles.resolve("paper"), every_set=True)


def with_profiles(monkeypatch, tmp_path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(profiles, "profiles_dir", lambda: tmp_path)


def test_a_typo_in_an_overlay_names_the_file_and_key(monkeypatch, tmp_path):
    with_profiles(monkeypatch, tmp_path, {"typo": "sweep: {log_evry: 5}\n"})
    with pytest.raises(ParamsError, match=r"typo\.yaml: sweep\.log_evry: the overlay sets a key"):
        profiles.resolve("typo")


def test_a_profile_is_validated_once_resolved(monkeypatch, tmp_path):
    with_profiles(monkeypatch, tmp_path, {"bad": "sweep: {log_every: 0}\n"})
    with pytest.raises(ParamsError, match=r"^profile bad: sweep\.log_every: must be >= 1, got 0$"):
        profiles.resolve("bad")


def test_extends_chains_overlays_and_refuses_a_loop(monkeypatch, tmp_path):
    with_profiles(
        monkeypatch,
        tmp_path,
        {
            "one": "report: {scale: one}\nsweep: {log_every: 7}\n",
            "two": "extends: one\nreport: {scale: two}\n",
            "a": "extends: b\n",
            "b": "extends: a\n",
        },
    )
    two = profiles.resolve("two")
    assert (two["report"]["scale"], two["sweep"]["log_every"]) == ("two", 7)
    assert profiles.resolve("two", under=profiles.load(REPO / "params.yaml"))["sweep"]["log_every"] == 50
    with pytest.raises(ParamsError, match="makes a loop"):
        profiles.resolve("a")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_config_prints_the_resolved_profile_as_yaml(capsys, tmp_path):
    code, out, _ = run_cli(["config", "--profile", "smoke"], capsys)
    assert code == 0 and out.startswith("# apg-pipeline config --profile smoke")
    assert yaml.safe_load(out) == profiles.resolve("smoke")
    code, out, _ = run_cli(["config", "--profile", "gpu-bmnist", "--check"], capsys)
    assert yaml.safe_load(out) == profiles.resolve("gpu-bmnist", check=True)
    code, out, _ = run_cli(["config", "--profile", "paper", "--out", str(tmp_path / "params.yaml")], capsys)
    assert code == 0 and yaml.safe_load((tmp_path / "params.yaml").read_text()) == profiles.resolve("paper")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--profile", "nope"], "apg-pipeline: error: unknown profile 'nope'; known: gpu-bmnist, "),
        (["--profile", "smoke", "--check"], "apg-pipeline: error: profile smoke has no check variant"),
    ],
)
def test_config_of_an_unknown_profile_is_a_one_line_error(capsys, argv, line):
    code, out, err = run_cli(["config", *argv], capsys)
    assert code == 2 and not out
    assert err.startswith(line) and err.count("\n") == 1
