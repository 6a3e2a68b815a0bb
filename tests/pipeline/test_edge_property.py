"""A property of the edge: whatever flags ``generate`` and ``train`` get (valid or not:
negatives, zero, NaN, infinities, huge numbers, junk strings, unknown keys and flags), a
call ends in a clean start or in one line ``... error: ...`` with exit status 2, never a
traceback. Params files likewise load or raise ``ParamsError``. The work after a clean
start is cut short (a few datasets simulated, no training step), so examples stay fast."""

from __future__ import annotations

import contextlib
import io
import math
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apg.tasks.simulation
from pipeline import cli
from pipeline.config.params import ParamsError, validate_params
from pipeline.runs import loop
from tests.support import REPO

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    database=None,  # nothing written into the repository
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Started(Exception):
    """Raised where the real work would begin: the call got past every check."""


# Numbers as text: small and huge, negative, zero, non-finite, and text that is no number.
INTS = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([0, -1, 10**6, 10**9, 10**12, 2**63, 2**64, 2**70, -(2**70)]),
).map(str)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e308", "1e-320", "0", "-0.0", "3e-3"]),
)
JUNK = st.sampled_from(
    ["", "abc", "[", "{", "1e3", ".nan", "-.inf", "0x10", "true", "null", "- 1", "1,2", "é"]
)
NUMBER = st.one_of(INTS, FLOATS, JUNK)
# Mostly in range, so that many calls get past the checks (and start) as well.
SMALL = st.integers(1, 12).map(str)
COUNT = st.integers(0, 9).flatmap(lambda i: SMALL if i < 6 else NUMBER)
VALUE = st.one_of(INTS, FLOATS, JUNK, st.sampled_from([".nan", ".inf", "[1, 2]", "{a: 1}", "-4", "0", "2.5"]))


def key_values(flag: str, keys: list[str]):
    value = st.integers(0, 9).flatmap(lambda i: SMALL if i < 4 else VALUE)
    pair = st.tuples(st.sampled_from(keys), value).map(lambda kv: [f"{flag}={kv[0]}={kv[1]}"])
    return st.one_of(pair, st.sampled_from([[f"{flag}=novalue"], [f"{flag}==1"]]))


def flags(options: dict[str, st.SearchStrategy], repeated: dict[str, st.SearchStrategy]):
    """A few of ``options`` and of ``repeated`` (``--name=value``: a value may start with
    '-'), in any order, now and then an unknown flag or a flag without its value."""
    single = [value.map(lambda v, name=name: [f"{name}={v}"]) for name, value in options.items()]
    extra = st.sampled_from([["--bogus", "1"], ["--num-datasets"], ["-K"], ["positional"]])
    item = st.integers(0, 19).flatmap(lambda i: extra if i == 0 else st.one_of(*single, *repeated.values()))
    return st.lists(item, max_size=4).map(lambda items: [arg for part in items for arg in part])


GENERATE = st.tuples(
    st.integers(0, 9).flatmap(
        lambda i: st.just([]) if i == 0 else COUNT.map(lambda n: [f"--num-datasets={n}"])
    ),
    flags(
        {
            "--num-points": COUNT,
            "--seed": NUMBER,
            "--task": st.sampled_from(["gmm", "dgmm", "nope", ""]),
        },
        {
            "--size": key_values("--size", ["num_points", "radius", "noise", "points"]),
            "--model": key_values("--model", ["nu0", "mu0", "num_clusters", "data_dim", "sigma0", "nope"]),
        },
    ),
).map(lambda parts: parts[0] + parts[1])
TRAIN = flags(
    {
        "--sweeps": COUNT,
        "--particles": COUNT,
        "--batch-size": COUNT,
        "--iterations": COUNT,
        "--lr": NUMBER,
        "--lr-final-factor": NUMBER,
        "--lr-hold-fraction": NUMBER,
        "--lr-schedule": st.sampled_from(["constant", "cosine", "nope"]),
        "--resampler": st.sampled_from(["systematic", "multinomial", "nope"]),
        "--resample-mode": st.sampled_from(["block", "sweep", "nope"]),
        "--threads": COUNT,
        "--seed": NUMBER,
        "--device": st.sampled_from(["cpu", "cpu:0", "cuda", "cuda:1", "tpu9", "mps", "meta", "", "xla"]),
        "--method": st.sampled_from(["apg", "rws-mlp", "hmc-rws", "nope"]),
        "--task": st.sampled_from(["gmm", "dgmm", "nope"]),
    },
    {
        "--model": key_values("--model", ["nu0", "num_clusters", "nope"]),
        "--network": key_values("--network", ["hidden", "c_inputs", "nope"]),
        "--option": key_values("--option", ["step_size", "nope"]),
    },
)


def outcome(argv: list[str]) -> str:
    """Run the command line in this process: "started", or "refused" after checking the
    one line it printed; anything else (a traceback) fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main(argv)
        except Started:
            return "started"
        except SystemExit as exit_:
            lines = err.getvalue().strip().splitlines()
            assert exit_.code == 2, (argv, exit_.code, lines)
            assert len(lines) == 1 and "Traceback" not in lines[0], (argv, lines)
            assert lines[0].startswith("apg-pipeline") and ": error: " in lines[0], (argv, lines)
            return "refused"
    return "done"  # a small set simulated and written in full


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("property")
    cli.main(["generate", "--out", str(root / "train.npz"), "--num-datasets", "6", "--num-points", "8"])
    return root


@SETTINGS
@given(argv=GENERATE)
def test_generate_starts_cleanly_or_refuses_in_one_line(data, argv):
    real = apg.tasks.simulation.simulate_set

    def simulate_set(task, model, num_datasets, seed, sizes):
        small = num_datasets <= 8 and all(not isinstance(v, int) or v <= 256 for v in sizes.values())
        if not small:  # past every check: the real work would begin here
            raise Started
        return real(task, model, num_datasets, seed, sizes)

    with mock.patch.object(apg.tasks.simulation, "simulate_set", simulate_set):
        outcome(["generate", "--out", str(data / "out.npz"), *argv])


@pytest.mark.slow  # each example builds a trainer: 9 s on a loaded 2-core machine
@SETTINGS
@given(argv=TRAIN)
def test_train_starts_cleanly_or_refuses_in_one_line(data, argv):
    def drive(*args, **kwargs):  # the trainer is built: the first step would come next
        raise Started

    with mock.patch.object(loop, "drive", drive):
        result = outcome(["train", "--data", str(data / "train.npz"), "--out", str(data / "c.pt"), *argv])
    assert result in ("started", "refused")


PARAM_KEYS = [
    ("gmm", "data", "train", "num_datasets"),
    ("gmm", "data", "train", "seed"),
    ("gmm", "data", "train", "sizes", "num_points"),
    ("gmm", "data", "test", "sizes", "num_points"),
    ("gmm", "model", "nu0"),
    ("gmm", "model", "num_clusters"),
    ("gmm", "network", "hidden"),
    ("gmm", "train", "lr"),
    ("gmm", "train", "batch_size"),
    ("gmm", "train", "iterations"),
    ("gmm", "evaluate", "seed"),
    ("gmm", "evaluate", "batch_size"),
    ("sweep", "log_every"),
    ("sweep", "storage"),
    ("report", "out"),
    ("gmm", "unknown_key"),
]
PARAM_VALUES = st.one_of(
    st.integers(-5, 100),
    st.sampled_from([0, -1, 10**12, 2**64, 2**70, True, None, [], {}, [1], "abc", "../../x", "/tmp/x"]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@pytest.fixture(scope="module")
def base_params():
    return yaml.safe_load((REPO / "params.yaml").read_text())


@settings(SETTINGS, max_examples=30)
@given(key=st.sampled_from(PARAM_KEYS), value=PARAM_VALUES)
def test_params_load_or_are_refused_naming_the_key(base_params, key, value):
    params = yaml.safe_load(yaml.safe_dump(base_params))
    params["tasks"] = ["gmm"]  # one task's section: the others are checked the same way
    where = params
    for part in key[:-1]:
        where = where[part]
    where[key[-1]] = value
    try:
        validate_params(params)
    except ParamsError as err:
        text = str(err)
        assert text and "\n" not in text, text
        return
    # Accepted: then the value is one the key can take.
    assert key[-1] != "unknown_key"
    assert not (isinstance(value, float) and not math.isfinite(value)), (key, value)
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        assert key[-1] in ("nu0", "seed", "iterations"), (key, value)  # finite floats, torch's seeds, 0 steps
    if key[-1] == "out":
        assert not value.startswith(("/", ".."))
