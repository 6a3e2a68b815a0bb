"""``params.yaml``: loading, validation and the grid of sweep cells.

Everything is checked here, before Ray or MLflow start, so that a bad params file
fails in well under a second with one line naming the key (``ParamsError``). The keys each
section allows and the checks of single values are ``pipeline.config.schema``.

Layout (see params.yaml for the documented defaults)::

    tasks: [gmm]                 # task sections the pipeline runs
    sweep: {...}                 # how Ray runs trials (shared by every task)
    tracking: {...}              # MLflow experiment
    report: {...}                # report options
    <task>:                      # one section per task: model, network, data,
      ...                        # train, grid, evaluate

A *cell* is one trial: (task, method, K, L, seed) plus the task's training options. A
grid entry's ``axes`` crosses any ``train``, ``network`` or ``model`` key as well::

    - methods: [apg]
      pairs: [[5, 10]]
      axes: {network.hidden: [16, 64], train.lr: [0.003, 0.01]}   # 4 cells per seed
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from apg.baselines import METHODS, get_method
from apg.tasks import get_task, task_names
from apg.training import TrainConfig
from pipeline.config import checks
from pipeline.config.schema import (
    AXIS_SECTIONS,
    DATA_KEYS,
    EVALUATE_KEYS,
    GRID_KEYS,
    IMPUTATION_KEYS,
    REPORT_KEYS,
    STATED_TRAIN_KEYS,
    SWEEP_KEYS,
    TASK_KEYS,
    TOP_KEYS,
    TRACKING_KEYS,
    TRAIN_KEYS,
    X_DTYPES,
    ParamsError,
    budget_pairs,
    check_data_set,
    check_mapping,
    check_pair,
    check_sweeps,
    first_line,
    is_kind,
    unknown_key,
)


@dataclass(frozen=True)
class Cell:
    """One trial of a sweep: a training config, a seed and where it came from."""

    task: str
    method: str
    sweeps: int
    particles: int
    seed: int
    train: TrainConfig
    # The values this cell takes on its grid entry's ``axes``, in the entry's order:
    # ``(("network.hidden", 64), ...)``; empty for a cell of the task's own settings.
    axes: tuple[tuple[str, Any], ...] = ()
    # Set by the sweep's plan: the id without the code, and the numerics fingerprint of the
    # code that trains it (apg.fingerprint).
    config_key: str | None = None
    fingerprint: str | None = None

    @property
    def name(self) -> str:
        """Human-readable name, also the MLflow child run's name."""
        name = f"{self.task}/{self.method}/K{self.sweeps}/L{self.particles}/seed{self.seed}"
        return f"{name}/{self.variant}" if self.axes else name

    @property
    def variant(self) -> str:
        """The swept settings as text (``network.hidden=64,train.lr=0.003``); '' for none."""
        return ",".join(f"{key}={value}" for key, value in self.axes)

    def cell_id(self, data_digest: str) -> str:
        """Stable id: the name plus a hash of everything that changes the result.

        A changed option (iterations, lr, model, data...) gives a new id, so a finished
        cell is reused only when it is really the same experiment.
        """
        cfg = self.train.to_dict()
        if not cfg["method_options"]:
            # Cells of methods without options keep the ids they had before options existed.
            del cfg["method_options"]
        if not cfg["compile"]:  # likewise the cells trained eagerly, before compile existed
            del cfg["compile"]
        payload = json.dumps({"cfg": cfg, "seed": self.seed, "data": data_digest}, sort_keys=True)
        digest = hashlib.sha256(payload.encode()).hexdigest()[:10]
        return f"{self.method}-K{self.sweeps}-L{self.particles}-s{self.seed}-{digest}"


def cell_key(method: str, sweeps: int, particles: int, seed: int) -> str:
    """A trained cell by method, K, L and seed: how a curriculum's later step (a recorded
    profile that starts from another's weights) finds the cell it starts from."""
    return f"{method}/K{sweeps}/L{particles}/s{seed}"


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (plain YAML keeps the
    last one silently; DVC rejects such a params file, so the two would disagree)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def read_yaml(path: Path, loader: type[yaml.SafeLoader] = _StrictLoader, mapping: bool = False) -> Any:
    """A YAML file's contents (``mapping``: one that must be a mapping); ``ParamsError`` naming
    the file and line for invalid YAML or a key given twice in one mapping."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ParamsError(f"{path} is not a YAML text file (byte {err.start}: {err.reason})") from None
    try:
        value = yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ParamsError(f"{path} is not valid YAML ({line}{problem})") from None
    if mapping and not isinstance(value, dict):
        raise ParamsError(f"{path} must hold a mapping of sections")
    return value


def load_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    """Read and validate a params file; raise ``ParamsError`` naming the bad key."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"params file not found: {path}")
    params = read_yaml(path, mapping=True)
    validate_params(params)
    return params


def validate_params(params: dict[str, Any]) -> None:
    """Check every section and every grid cell (builds each cell's ``TrainConfig``)."""
    known_tasks = task_names()
    for key in params:
        if key not in TOP_KEYS and key not in known_tasks:
            raise ParamsError(
                unknown_key(key, [*TOP_KEYS, *known_tasks], "top-level section or registered task")
            )
    tasks = params.get("tasks")
    if not isinstance(tasks, list):
        raise ParamsError("tasks: missing" if tasks is None else f"tasks: must be a list, got {tasks!r}")
    if not tasks:
        raise ParamsError("tasks: list at least one task")
    for i, task in enumerate(tasks):
        if task not in known_tasks:
            raise ParamsError(f"tasks[{i}]: unknown task {task!r}; registered tasks: {known_tasks}")
        if task not in params:
            raise ParamsError(f"tasks[{i}]: task {task!r} has no section {task}: in the params file")
    sweep = check_mapping(params.get("sweep"), "sweep", SWEEP_KEYS, required=True)
    if "storage" in sweep:  # a cluster's shared storage may be absolute; a relative one stays inside
        checks.relative_stays_inside(sweep["storage"], "sweep.storage")
    check_mapping(params.get("tracking"), "tracking", TRACKING_KEYS)
    report = check_mapping(params.get("report"), "report", REPORT_KEYS)
    if "out" in report:  # the report stage writes there: inside the project
        checks.inside_project(report["out"], "report.out")
    for task in tasks:
        validate_task(params, task)


def validate_task(params: dict[str, Any], task: str) -> None:
    section = check_mapping(params[task], task, TASK_KEYS, required=True)
    spec = get_task(task)
    model = checks.build_model(task, section.get("model") or {}, f"{task}.model")
    checks.network_values(section.get("network") or {}, f"{task}.network")
    data = check_mapping(section.get("data"), f"{task}.data", DATA_KEYS)
    if "train" not in data:
        raise ParamsError(f"{task}.data.train: missing")
    check_data_set(data["train"], f"{task}.data.train")
    if "network" in data["train"]:
        raise ParamsError(
            f"{task}.data.train.network: training uses {task}.network; overrides are for held-out sets"
        )
    if data.get("x_dtype", "float32") not in X_DTYPES:
        raise ParamsError(f"{task}.data.x_dtype: must be one of {list(X_DTYPES)}, got {data['x_dtype']!r}")
    sets = evaluation_sets(section, where=f"{task}.data")  # checks names and each entry
    for entry in [{**data["train"], "where": f"{task}.data.train"}, *sets]:
        checks.size_values(task, entry.get("sizes") or {}, f"{entry['where']}.sizes")
    check_mapping(section.get("train"), f"{task}.train", TRAIN_KEYS)
    cells = grid_cells(params, task)  # validates every cell's TrainConfig
    network = section.get("network", {})
    overrides = {json.dumps(s.get("network", {}), sort_keys=True): s["where"] for s in sets}
    models: dict[str, Cell] = {}
    networks: dict[tuple[str, str], Cell] = {}
    for c in cells:  # the first cell of each distinct model and (method, network)
        models.setdefault(json.dumps(c.train.model, sort_keys=True), c)
        networks.setdefault((c.method, json.dumps(c.train.network, sort_keys=True)), c)
    for cell in models.values():  # a model an entry's axes set
        checks.build_model(task, cell.train.model, f"{task}.grid ({cell.name}): model")
    # Every network a cell trains (the task's, or one its axes set) under every override.
    for (method, cell_network), cell in networks.items():
        for key, where in overrides.items():
            try:
                merged = {**json.loads(cell_network), **json.loads(key)}
                checks.network_values(merged, "network")
                get_method(method).build_proposals(spec, model, **merged)
            except (TypeError, ValueError, RuntimeError) as err:
                at = f"{where}.network" if key != "{}" else f"{task}.network"
                if json.loads(cell_network) != network:
                    at = f"{task}.grid ({cell.name})"
                raise ParamsError(f"{at}: {first_line(err)} (method {method})") from None
    ev = check_mapping(section.get("evaluate"), f"{task}.evaluate", EVALUATE_KEYS)
    for j, pair in enumerate(ev.get("pairs", [])):
        check_pair(pair, f"{task}.evaluate.pairs[{j}]")
    if "budget" in ev:
        budget_pairs(ev["budget"], f"{task}.evaluate.budget")
    if "baseline" in ev and ev["baseline"] not in METHODS:
        raise ParamsError(
            f"{task}.evaluate.baseline: unknown method {ev['baseline']!r}; choose one of {sorted(METHODS)}"
        )
    for key in ("batch_size", "figure_particles", "threads"):
        if key in ev and ev[key] < (2 if key == "figure_particles" else 1):
            raise ParamsError(f"{task}.evaluate.{key}: too small ({ev[key]})")
    if "seed" in ev:
        checks.seed(ev["seed"], f"{task}.evaluate.seed")
    check_sweeps(ev.get("figure_sweeps", []), f"{task}.evaluate.figure_sweeps")
    if "imputation" in ev:
        _check_imputation(ev["imputation"], section, f"{task}.evaluate.imputation")


def _check_imputation(imp: dict[str, Any], section: dict[str, Any], where: str) -> None:
    imp = check_mapping(imp, where, IMPUTATION_KEYS)
    if not imp.get("methods"):
        raise ParamsError(f"{where}.methods: list the methods whose cells impute (e.g. [apg])")
    for j, method in enumerate(imp["methods"]):
        if method not in METHODS:
            raise ParamsError(
                f"{where}.methods[{j}]: unknown method {method!r}; choose from {sorted(METHODS)}"
            )
    names = [e["name"] for e in evaluation_sets(section) if e["kind"] == "test"]
    if "test_set" in imp and imp["test_set"] not in names:
        raise ParamsError(f"{where}.test_set: {imp['test_set']!r} is not a test set of this task ({names})")
    if "pair" in imp:
        check_pair(imp["pair"], f"{where}.pair")
    if "seed" in imp:
        checks.seed(imp["seed"], f"{where}.seed")
    if imp.get("burn_in", 0) >= imp.get("iterations", 10):
        raise ParamsError(f"{where}.burn_in: must be below iterations ({imp.get('iterations', 10)})")
    if imp.get("fill", "sample") not in ("sample", "mean"):
        raise ParamsError(f"{where}.fill: sample (draw from p(x | z)) or mean, got {imp['fill']!r}")
    if "fraction" in imp and not 0 < imp["fraction"] < 1:
        raise ParamsError(f"{where}.fraction: must be in (0, 1), got {imp['fraction']}")
    for j, occ in enumerate(imp.get("occlusions", [])):
        ok = isinstance(occ, dict) and (
            set(occ) <= {"start", "frames"} and "frames" in occ or set(occ) == {"rows", "cols"}
        )
        if not ok:
            raise ParamsError(
                f"{where}.occlusions[{j}]: {{start, frames}} (frames blanked) or {{rows: [a, b], cols: [a, b]}} "
                f"(a region hidden in every frame), got {occ!r}"
            )
        frames = [v for k, v in occ.items() if k in ("start", "frames")]
        ranges = [v for k, v in occ.items() if k in ("rows", "cols")]
        if not all(is_kind(v, int) and v >= 1 for v in frames) or not all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(b, int) for b in v) and 0 <= v[0] < v[1]
            for v in ranges
        ):
            raise ParamsError(
                f"{where}.occlusions[{j}]: bad bounds {occ!r} (frames >= 1; ranges [a, b] with a < b)"
            )


def evaluation_sets(section: dict[str, Any], where: str = "data") -> list[dict[str, Any]]:
    """The held-out and figure sets of a task section, each with its file ``stem``.

    ``data.test`` (one set, file ``test.npz``, name ``test``) and ``data.tests`` (a list of
    sets, each with a unique ``name``, files ``test_<name>.npz``) may be given alone or
    together. Figure sets are ``figure_<i>.npz`` (``kind: figure``). Any set may carry
    ``network``: proposal-network keyword overrides used when evaluating on it (e.g. the
    number of objects to track), merged over ``<task>.network``; they must not change the
    shapes of the trained weights.

    Returns ``[{"name", "stem", "kind": "test" | "figure", "where", **entry}]``, test sets first.
    """
    data = section.get("data") or {}

    def entry(value: Any, at: str, kind: str, stem: str | None = None) -> dict[str, Any]:
        check_data_set(value, at)
        return {"name": stem, **value, "stem": stem, "kind": kind, "where": at}

    sets = [entry(data["test"], f"{where}.test", "test", "test")] if "test" in data else []
    tests = data.get("tests") or []
    if not isinstance(tests, list):
        raise ParamsError(f"{where}.tests: must be a list of data sets, got {tests!r}")
    for i, value in enumerate(tests):
        sets.append(entry(value, f"{where}.tests[{i}]", "test"))
        name = sets[-1]["name"]
        if not name or not all(ch.isalnum() or ch in "-_." for ch in name):
            raise ParamsError(
                f"{where}.tests[{i}].name: give each test set a name of letters, digits, '-', '_' or '.', "
                f"got {name!r}"
            )
        sets[-1]["stem"] = f"test_{name}"
    if not sets:
        raise ParamsError(f"{where}.test: missing (give test: {{...}} or tests: [{{name: ..., ...}}])")
    names = [s["name"] for s in sets]
    for name in names:
        if names.count(name) > 1:
            raise ParamsError(f"{where}.tests: duplicate test set name {name!r}")
    sets += [
        entry(e, f"{where}.figures[{i}]", "figure", f"figure_{i}")
        for i, e in enumerate(data.get("figures") or [])
    ]
    return sets


def grid_cells(params: dict[str, Any], task: str) -> list[Cell]:
    """Expand ``<task>.grid`` into cells (validated ``TrainConfig`` each), in grid order.

    Each grid entry crosses its ``methods`` x budgets x ``seeds``; budgets are either
    explicit ``pairs: [[K, L], ...]`` or ``budget: {total: K*L, sweeps: [K, ...]}`` with
    ``L = total // K``; ``axes`` crosses any train/network/model keys as well. Cells of the
    same experiment are kept once; two different experiments under one name are an error.
    """
    section = params[task]
    train = dict(section.get("train", {}))
    options = _method_options(train.pop("method_options", None) or {}, task)
    cells: dict[str, Cell] = {}
    grid = section.get("grid")
    if not isinstance(grid, list) or not grid:
        raise ParamsError(f"{task}.grid: must be a non-empty list of entries")
    for i, entry in enumerate(grid):
        where = f"{task}.grid[{i}]"
        entry = check_mapping(entry, where, GRID_KEYS)
        methods = entry.get("methods")
        if not methods:
            raise ParamsError(f"{where}.methods: list at least one method")
        pairs = _entry_pairs(entry, where)
        overrides = entry.get("train") or {}
        check_mapping(
            overrides, f"{where}.train", {k: v for k, v in TRAIN_KEYS.items() if k != "method_options"}
        )
        entry_train = {**train, **overrides}
        missing = [k for k in STATED_TRAIN_KEYS if k not in entry_train]
        if missing:
            raise ParamsError(f"{task}.train: set {', '.join(missing)} (a cell's numbers have no default)")
        # Its keys are checked where every cell's network is built (validate_params).
        entry_network = {**section.get("network", {}), **(entry.get("network") or {})}
        axes = check_axes(entry.get("axes") or {}, f"{where}.axes")
        seeds = entry.get("seeds", [0])
        if not isinstance(seeds, list) or not seeds:
            raise ParamsError(f"{where}.seeds: must be a non-empty list of integers, got {seeds!r}")
        for j, seed in enumerate(seeds):
            checks.seed(seed, f"{where}.seeds[{j}]")
        for j, method in enumerate(methods):
            if method not in METHODS:
                raise ParamsError(
                    f"{where}.methods[{j}]: unknown method {method!r}; choose one of {sorted(METHODS)}"
                )
            for (k, l), setting, seed in itertools.product(pairs, axis_settings(axes), seeds):
                base = TrainConfig(
                    task=task,
                    method=method,
                    sweeps=k,
                    particles=l,
                    model=dict(section.get("model", {})),
                    network=dict(entry_network),
                    method_options=dict(options.get(method, {})),
                    **entry_train,
                )
                cfg = TrainConfig.from_dict(apply_setting(base.to_dict(), dict(setting)))
                _validate_config(cfg, task, where, axes, overrides)
                cell = Cell(task, method, k, l, seed, cfg, axes=setting)
                # One cell per experiment: an axis value equal to the task's own setting is
                # the cell another entry already trains (it keeps that entry's name).
                cells.setdefault(json.dumps({"seed": seed, "cfg": cfg.to_dict()}, sort_keys=True), cell)
    names: dict[str, Cell] = {}
    for cell in cells.values():
        if names.setdefault(cell.name, cell) is not cell:
            raise ParamsError(
                f"{task}.grid: two entries train {cell.name} with different settings; "
                "tell them apart with axes: {section.key: [values]}"
            )
    return list(cells.values())


def _method_options(options: dict[str, Any], task: str) -> dict[str, Any]:
    """``<task>.train.method_options`` (``{method name: {option: value}}``), checked."""
    for name, opts in options.items():
        if name not in METHODS:
            raise ParamsError(
                f"{task}.train.method_options.{name}: unknown method; choose one of {sorted(METHODS)}"
            )
        if not isinstance(opts, dict):
            raise ParamsError(
                f"{task}.train.method_options.{name}: must be a mapping of options, got {opts!r}"
            )
    return options


def _entry_pairs(entry: dict[str, Any], where: str) -> list[tuple[int, int]]:
    """A grid entry's training budgets: its ``pairs``, then its ``budget``'s pairs."""
    pairs: list[tuple[int, int]] = []
    for j, pair in enumerate(entry.get("pairs", [])):
        pairs.append(check_pair(pair, f"{where}.pairs[{j}]"))
    if "budget" in entry:
        pairs += budget_pairs(entry["budget"], f"{where}.budget")
    if not pairs:
        raise ParamsError(f"{where}: give pairs: [[K, L], ...] or budget: {{total: ..., sweeps: [...]}}")
    return pairs


def _validate_config(
    cfg: TrainConfig, task: str, where: str, axes: dict[str, list[Any]], overrides: dict[str, Any]
) -> None:
    """``cfg.validate()``, its error raised as ``ParamsError`` naming the key that set the bad
    value: the method's options, the entry's axis, the entry's ``train`` or the task's."""
    try:
        cfg.validate()
    except ValueError as err:
        field = first_line(err).split(" ")[0]
        head, _, rest = field.partition(".")
        if head == "method_options":
            key = f"{task}.train.method_options.{cfg.method}" + (f".{rest}" if rest else "")
        elif f"train.{field}" in axes:
            key = f"{where}.axes.train.{field}"
        else:
            section_key = f"{where}.train" if field in overrides else f"{task}.train"
            key = f"{section_key}.{field}" if field in TRAIN_KEYS else where
        raise ParamsError(f"{key}: {first_line(err)}") from None


def check_axes(axes: dict[str, Any], where: str) -> dict[str, list[Any]]:
    """A grid entry's ``axes`` (``{section.key: [values]}``), checked; ParamsError otherwise."""
    out: dict[str, list[Any]] = {}
    for key, values in axes.items():
        section, _, name = str(key).partition(".")
        if section not in AXIS_SECTIONS or not name:
            raise ParamsError(
                f"{where}.{key}: axes are <section>.<key> with section one of {list(AXIS_SECTIONS)}"
            )
        if section == "train" and (name not in TRAIN_KEYS or name == "method_options"):
            known = [k for k in TRAIN_KEYS if k != "method_options"]
            raise ParamsError(unknown_key(f"{where}.{key}", known, "training key"))
        if not isinstance(values, list) or not values:
            raise ParamsError(f"{where}.{key}: must be a non-empty list of values, got {values!r}")
        if section == "train":
            for j, value in enumerate(values):
                if not is_kind(value, TRAIN_KEYS[name]):
                    raise ParamsError(f"{where}.{key}[{j}]: wrong type for train.{name}, got {value!r}")
        out[str(key)] = values
    return out


def axis_settings(axes: dict[str, list[Any]]) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the axes' values, as ``((key, value), ...)`` in the axes' order."""
    return [tuple(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def apply_setting(cfg: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """A ``TrainConfig`` dict with ``{"train.lr": 0.01, "network.hidden": 64, ...}`` applied."""
    out = json.loads(json.dumps(cfg))
    for key, value in setting.items():
        section, _, name = key.partition(".")
        if section == "train":
            out[name] = value
        else:
            out[section] = {**out.get(section, {}), name: value}
    return out


def setting_of(cfg: dict[str, Any], key: str) -> Any:
    """The value of ``section.key`` in a ``TrainConfig`` dict (None when the task's default)."""
    section, _, name = key.partition(".")
    return cfg.get(name) if section == "train" else cfg.get(section, {}).get(name)


def axis_keys(params: dict[str, Any], task: str) -> list[str]:
    """Every key some grid entry of ``task`` sweeps, in first-seen order."""
    keys: dict[str, None] = {}
    for entry in params[task].get("grid", []):
        keys.update(dict.fromkeys((entry.get("axes") or {}).keys()))
    return list(keys)


def evaluation_pairs(params: dict[str, Any], task: str) -> dict[str, list[tuple[int, int]]]:
    """Test-time (K, L) pairs per analysis: ``pairs`` (Table 1, curves) and ``budget`` (Figure 2)."""
    ev = params[task].get("evaluate", {})
    out = {"pairs": [tuple(p) for p in ev.get("pairs", [])]}
    if "budget" in ev:
        out["budget"] = budget_pairs(ev["budget"], f"{task}.evaluate.budget")
    return out
