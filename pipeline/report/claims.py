"""The paper's claims checked on the evaluation rows: one rule per claim kind and the claims
table; a recorded replication's verdicts beside them (their JSON: ``headline``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd

from pipeline.present import markdown_table, number
from pipeline.report.data import finals, load_results, main_rows, primary_test_set, retrained_rows
from pipeline.report.departures import FLAG, FLAG_RULE, claim_departure
from pipeline.report.tables import METRIC_LABELS, _flagged
from pipeline.report.training import flag_notes, row_flag
from pipeline.statistics import MIN_SEEDS, Estimate, detectable, difference, equivalent, seed_interval

NOT_ENOUGH_SEEDS = "n/a ({n} seed{s})"

AT_CEILING = "at ceiling: not testable here"

VERDICT_RULES = (
    "Each number is a mean over seeds of the per-seed mean over the held-out datasets of the "
    "first test set (or of the set a claim names); [lo, hi] is a Student-t 95% interval over those "
    f"seed means. A claim resting on fewer than {MIN_SEEDS} seeds gets no verdict ('n/a (k seeds)') "
    "and is not counted. Threshold claims (≥, ≤) use the mean. Comparisons of two methods (or of two "
    "budgets' retrained cells) are about the difference of their means: 'A above B' ('below') needs "
    "Welch's 95% interval of mean(A) − mean(B) above (below) zero, 'A ≥ B' compares the means, and "
    "'equivalent within ±m' needs Welch's 90% interval inside (−m, m) (two one-sided tests at 5%; "
    "the margins m are set in pipeline/paper_numbers.yaml with their reasons). Claims about one "
    "cell are paired (same cell, same held-out dataset): 'falls over sweeps' takes per seed the mean "
    "of the last sweep's value minus the first sweep's and needs that change's 95% interval below "
    "zero; 'above another metric' takes per seed the mean of each metric minus the other one and "
    "needs every such difference's interval above zero; "
    "'increasing with K' takes the change from each K to the next the same way and needs "
    "every change's interval above zero, unless the metric already lies within the claim's stated "
    f"margin of its ceiling at the smallest K ('{AT_CEILING}'). 'converges within k sweeps' takes "
    "per seed the first sweep whose value (mean over the datasets) lies within the stated tolerance "
    "of the plateau, the mean of the run's last sweeps, and needs the upper end of the 95% interval "
    "of that sweep's mean over seeds at or below k. 'detectable': the smallest true "
    "effect (difference, change, or distance from a target) a two-sided 95% test on these seeds "
    "finds with 80% power, (t_0.975 + t_0.8)·SE. 'not run': the method, budget or metric is absent "
    "from these results."
)


def _rows(frame: pd.DataFrame, method: str, metric: str, pair: tuple[int, int]) -> pd.DataFrame:
    """``method``'s rows of ``metric`` at test-time ``pair``, indexed by (cell_id, dataset)."""
    k, l = pair
    at = frame[
        (frame["method"] == method) & (frame["K"] == k) & (frame["L"] == l) & (frame["metric"] == metric)
    ]
    return at.set_index(["cell_id", "dataset"])


def _over_seeds(values: pd.Series, rows: pd.DataFrame) -> Estimate:
    """Per-dataset ``values`` (indexed like ``rows``): per seed their mean, then ``seed_interval``."""
    values = values.dropna()
    if values.empty:
        return seed_interval([])
    per_seed = values.groupby(rows["seed"].reindex(values.index)).mean()
    return seed_interval(per_seed.to_numpy(), tuple(sorted(set(values.index.get_level_values("cell_id")))))


def seed_estimate(fin: pd.DataFrame, method: str, metric: str, pair: tuple[int, int]) -> Estimate:
    """``metric`` of ``method``'s final particles at test-time ``pair``: per seed the mean
    over held-out datasets, then ``seed_interval``."""
    rows = _rows(fin, method, metric, pair)
    return _over_seeds(rows["value"], rows)


def paired_change(
    before: pd.DataFrame,
    after: pd.DataFrame,
    method: str,
    metric: str,
    pair: tuple[int, int],
    after_pair: tuple[int, int] | None = None,
    after_metric: str | None = None,
) -> Estimate:
    """``after - before`` of ``metric`` for the same cell and held-out dataset (two sweeps of
    one run at ``pair``, two test-time budgets ``pair`` → ``after_pair``, or two metrics
    ``metric`` → ``after_metric`` of the same run): per seed the
    mean over datasets, then ``seed_interval``. Paired, so the spread between seeds and
    datasets that both share cancels."""
    a, b = (
        _rows(before, method, metric, pair),
        _rows(after, method, after_metric or metric, after_pair or pair),
    )
    return _over_seeds(b["value"] - a["value"].reindex(b.index), b)


def retrained_estimates(retrained: pd.DataFrame, method: str, metric: str) -> dict[tuple[int, int], Estimate]:
    """``{(K, L): Estimate}`` over the cells retrained per budget (Figure 2), each evaluated
    at its own training pair."""
    sub = retrained[(retrained["method"] == method) & (retrained["metric"] == metric)]
    return {
        (int(k), int(l)): seed_estimate(part, method, metric, (int(k), int(l)))
        for (k, l), part in sub.groupby(["K", "L"])
    }


class ClaimResult(NamedTuple):
    """One checked claim: ``ours`` and ``target`` as printed; ``passed`` None when no verdict
    can be given (not run, fewer than ``MIN_SEEDS`` seeds, at the metric's ceiling), and then
    ``note`` says why; ``value``/``lo``/``hi``/``target_value`` for metrics-full.json;
    ``detectable``: the smallest effect its seeds could detect (``statistics.detectable``);
    ``departure``: where ``ours`` is more than 2x from the paper's own number, either way, the
    ratio and its recorded reason (``departures.claim_departure``), else ""."""

    task: str
    id: str
    claim: str
    section: str
    ours: str
    target: str
    passed: bool | None
    note: str
    value: Any
    lo: Any
    hi: Any
    target_value: Any
    cells: tuple[str, ...]
    detectable: float = math.nan
    departure: str = ""


def _est(e: Estimate) -> str:
    """``mean [lo, hi]``, or ``mean (n/a, 1 seed)``."""
    if not e.n:
        return "n/a"
    if e.n < MIN_SEEDS:
        return f"{number(e.mean)} (interval n/a, {e.n} seed{'s' if e.n > 1 else ''})"
    return f"{number(e.mean)} [{number(e.lo)}, {number(e.hi)}]"


def _largest(values) -> float:
    """The largest of ``values``, NaN when any is NaN (a claim is as detectable as its least
    detectable part)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _seed_note(*estimates: Estimate) -> str:
    """Why no verdict: too few seeds behind one of ``estimates`` ('' when there are enough)."""
    n = min(e.n for e in estimates)
    return NOT_ENOUGH_SEEDS.format(n=n, s="s" if n > 1 else "") if n < MIN_SEEDS else ""


OPS = {">=": (lambda a, b: a >= b, "≥"), "<=": (lambda a, b: a <= b, "≤")}


class Claim(NamedTuple):
    """What every claim kind's rule reads: the claim's spec, and the rows it is checked on,
    already narrowed to its held-out set and training budget. ``fin``: the final metrics of
    the main cells; ``mine``: the same for the claim's own method (its numbers after
    ``sweep`` when the claim names one); ``curves``: every sweep's rows; ``retrained``: the
    budget cells (Figure 2)."""

    spec: dict[str, Any]
    task: str
    fin: pd.DataFrame
    mine: pd.DataFrame
    curves: pd.DataFrame | None
    retrained: pd.DataFrame

    @property
    def method(self) -> str:
        return self.spec["method"]

    @property
    def metric(self) -> str:
        return self.spec.get("metric", "")

    @property
    def pair(self) -> tuple[int, int]:
        return tuple(self.spec.get("pair", (0, 0)))

    @property
    def who(self) -> str:
        at_sweep = self.spec.get("sweep")
        return f"{self.method} K={self.pair[0]} L={self.pair[1]}" + (
            f" after sweep {at_sweep}" if at_sweep is not None else ""
        )

    def result(
        self, ours, passed, note, value, lo, hi, target_value, cells, smallest=math.nan
    ) -> ClaimResult:
        """The checked claim; no verdict when ``note`` says why (too few seeds, at the ceiling)."""
        spec = self.spec
        if "test_set" in spec and note != "not run":
            ours = f"{spec['test_set']}, {ours}"
        passed = None if note else passed
        head = (self.task, spec["id"], spec["claim"], spec.get("section", ""))
        return ClaimResult(
            *head, ours, claim_target(spec), passed, note, value, lo, hi, target_value, tuple(cells), smallest
        )

    def not_run(self) -> ClaimResult:
        return self.result("not run", None, "not run", None, None, None, None, ())


def _threshold(c: Claim) -> ClaimResult:
    e = seed_estimate(c.mine, c.method, c.metric, c.pair)
    if not e.n:
        return c.not_run()
    ok = OPS[c.spec["op"]][0](e.mean, c.spec["target"])
    return c.result(
        f"{c.who}: {_est(e)}",
        bool(ok),
        _seed_note(e),
        e.mean,
        e.lo,
        e.hi,
        c.spec["target"],
        e.cells,
        detectable(e),
    )


def _falls_over_sweeps(c: Claim) -> ClaimResult:
    rows = c.curves if c.curves is not None else c.fin
    first = seed_estimate(rows[rows["sweep"] == 1], c.method, c.metric, c.pair)
    last = seed_estimate(c.fin, c.method, c.metric, c.pair)
    change = paired_change(rows[rows["sweep"] == 1], c.fin, c.method, c.metric, c.pair)
    if not first.n or not last.n or not change.n:
        return c.not_run()
    k, l = c.pair
    ours = f"{c.method} K={k} L={l}: sweep 1 {_est(first)} → sweep {k} {_est(last)}; change {_est(change)}"
    ok = change.hi < 0
    return c.result(
        ours, ok, _seed_note(change), last.mean, last.lo, last.hi, first.mean, last.cells, detectable(change)
    )


def _compare(c: Claim) -> ClaimResult:
    """above, below, at_least, equivalent: the claim's method against ``other``."""
    spec, kind, other = c.spec, c.spec["kind"], c.spec["other"]
    other_pair = tuple(spec.get("other_pair", c.pair))
    a, b = (
        seed_estimate(c.mine, c.method, c.metric, c.pair),
        seed_estimate(c.fin, other, c.metric, other_pair),
    )
    if not a.n or not b.n:
        return c.not_run()
    d = difference(a, b)
    ok = {
        "above": lambda: d.lo > 0,
        "below": lambda: d.hi < 0,
        "at_least": lambda: a.mean >= b.mean,
        "equivalent": lambda: equivalent(d, spec["margin"]),
    }[kind]()
    if other_pair != c.pair or spec.get("sweep") is not None:
        ours = f"{c.who} {_est(a)} vs {other} K={other_pair[0]} L={other_pair[1]} {_est(b)}"
    else:
        ours = f"K={c.pair[0]} L={c.pair[1]}: {c.method} {_est(a)} vs {other} {_est(b)}"
    if kind != "at_least":
        ours += f"; difference {_est(d)}"
    ref = {"method": other, "value": b.mean, "lo": b.lo, "hi": b.hi, "difference": [d.mean, d.lo, d.hi]}
    return c.result(ours, ok, _seed_note(a, b), a.mean, a.lo, a.hi, ref, a.cells + b.cells, detectable(d))


def _above_metric(c: Claim) -> ClaimResult:
    """Several metrics of one method's cells against another metric of the same cells."""
    metrics, other_metric = c.spec["metrics"], c.spec["other_metric"]
    ests = {m: seed_estimate(c.fin, c.method, m, c.pair) for m in metrics}
    diffs = {m: paired_change(c.fin, c.fin, c.method, other_metric, c.pair, after_metric=m) for m in metrics}
    other = seed_estimate(c.fin, c.method, other_metric, c.pair)
    if not other.n or any(not e.n for e in (*ests.values(), *diffs.values())):
        return c.not_run()
    ok = all(d.lo > 0 for d in diffs.values())
    ours = f"{c.who}: {other_metric} {_est(other)}; " + "; ".join(
        f"{m} {_est(ests[m])}, difference {_est(diffs[m])}" for m in metrics
    )
    return c.result(
        ours,
        ok,
        _seed_note(other, *diffs.values()),
        [ests[m].mean for m in metrics],
        [ests[m].lo for m in metrics],
        [ests[m].hi for m in metrics],
        {"metric": other_metric, "value": other.mean, "lo": other.lo, "hi": other.hi},
        tuple(cell for e in ests.values() for cell in e.cells),
        _largest(detectable(d) for d in diffs.values()),
    )


def _converges_within(c: Claim) -> ClaimResult:
    """Per seed: the dataset-mean curve over sweeps, its plateau (the mean of the last
    sweeps) and the first sweep whose value comes within the tolerance of it."""
    spec = c.spec
    rows = c.curves if c.curves is not None and "sweep" in c.curves else c.fin.iloc[:0]
    if "test_set" not in spec and "test_set" in rows and "test_set" in c.fin and len(c.fin):
        rows = rows[rows["test_set"] == c.fin["test_set"].iloc[0]]
    rows = _rows(rows, c.method, c.metric, c.pair).reset_index()
    if rows.empty:
        return c.not_run()
    firsts = {}
    for cell_id, cell_rows in rows.groupby("cell_id"):
        curve = cell_rows.groupby("sweep")["value"].mean().sort_index()
        level = curve.iloc[-spec["plateau_sweeps"] :].mean()
        reached = curve.index[curve.to_numpy() >= level - spec["tolerance"]]
        firsts[cell_id] = (int(cell_rows["seed"].iloc[0]), float(reached[0]))
    per_seed = pd.Series({seed: k for seed, k in firsts.values()}, dtype=float)
    e = seed_interval(per_seed.to_numpy(), tuple(sorted(firsts)))
    ours = (
        f"{c.who}: first sweep within {spec['tolerance']} of the plateau {_est(e)} (per seed: "
        + ", ".join(f"{int(k)}" for k in per_seed.sort_index())
        + ")"
    )
    ok = e.hi <= spec["sweeps"]
    return c.result(ours, bool(ok), _seed_note(e), e.mean, e.lo, e.hi, spec["sweeps"], e.cells, detectable(e))


def _increasing(c: Claim) -> ClaimResult:
    spec = c.spec
    pairs = [tuple(p) for p in spec["pairs"]]
    ests = [seed_estimate(c.fin, c.method, c.metric, p) for p in pairs]
    if any(not e.n for e in ests):
        return c.not_run()
    steps = [
        paired_change(c.fin, c.fin, c.method, c.metric, p, q) for p, q in zip(pairs, pairs[1:], strict=False)
    ]
    if any(not s.n for s in steps):
        return c.not_run()
    note = _seed_note(*ests, *steps)
    # A metric already at its ceiling at the smallest K has no room to rise: not a test,
    # unless it falls (a change's interval below 0 fails the claim wherever it starts).
    near = "ceiling" in spec and ests[0].mean >= spec["ceiling"] - spec["ceiling_margin"]
    if not note and near and not any(s.hi < 0 for s in steps):
        note = AT_CEILING
    ok = all(s.lo > 0 for s in steps)
    ours = f"{c.method}: " + "; ".join(f"K={k}: {_est(e)}" for (k, _), e in zip(pairs, ests, strict=True))
    ours += "; changes " + "; ".join(
        f"{p[0]}→{q[0]}: {_est(s)}" for p, q, s in zip(pairs, pairs[1:], steps, strict=False)
    )
    return c.result(
        ours,
        ok,
        note,
        [e.mean for e in ests],
        [e.lo for e in ests],
        [e.hi for e in ests],
        "increasing",
        tuple(cell for e in ests for cell in e.cells),
        _largest(detectable(s) for s in steps),
    )


def _budget_above(c: Claim) -> ClaimResult:
    """Figure 2 from cells retrained at each (K, L = total // K): the largest K above the smallest."""
    ests = retrained_estimates(c.retrained, c.method, c.metric)
    if len(ests) < 2:
        return c.not_run()
    pairs = sorted(ests)
    low, high = ests[pairs[0]], ests[pairs[-1]]
    d = difference(high, low)
    ok = d.lo > 0
    label = METRIC_LABELS.get(c.metric, c.metric)
    ours = f"{c.method} retrained, {label}: " + "; ".join(
        f"K={k} L={l}: {_est(ests[(k, l)])}" for k, l in pairs
    )
    ours += f"; difference K={pairs[-1][0]} − K={pairs[0][0]}: {_est(d)}"
    return c.result(
        ours,
        ok,
        _seed_note(low, high),
        [ests[p].mean for p in pairs],
        [ests[p].lo for p in pairs],
        [ests[p].hi for p in pairs],
        "increasing in K",
        tuple(cell for e in ests.values() for cell in e.cells),
        detectable(d),
    )


def _steps(spec: dict[str, Any]) -> str:
    return "→".join(str(k) for k, _ in spec["pairs"])


def _other_at(spec: dict[str, Any]) -> str:
    return f" at K={spec['other_pair'][0]} L={spec['other_pair'][1]}" if "other_pair" in spec else ""


class ClaimKind(NamedTuple):
    """A kind of claim: its rule (``Claim -> ClaimResult``) and what it asks for, as printed
    in the claims table's ``target`` column."""

    check: Callable[[Claim], ClaimResult]
    target: Callable[[dict[str, Any]], str]


KINDS: dict[str, ClaimKind] = {
    "threshold": ClaimKind(_threshold, lambda s: f"{OPS[s['op']][1]} {s['target']}"),
    "above": ClaimKind(
        _compare, lambda s: f"above {s['other']}{_other_at(s)} (difference's 95% interval above 0)"
    ),
    "below": ClaimKind(
        _compare, lambda s: f"below {s['other']}{_other_at(s)} (difference's 95% interval below 0)"
    ),
    "at_least": ClaimKind(_compare, lambda s: f"≥ {s['other']} (means)"),
    "equivalent": ClaimKind(
        _compare,
        lambda s: f"within ±{s['margin']} of {s['other']} (difference's 90% interval inside the margin)",
    ),
    "increasing": ClaimKind(
        _increasing,
        lambda s: f"increasing at every step of K {_steps(s)} (each paired change's 95% interval above 0)",
    ),
    "falls_over_sweeps": ClaimKind(
        _falls_over_sweeps, lambda s: "last sweep below sweep 1 (paired change's 95% interval below 0)"
    ),
    "budget_above": ClaimKind(
        _budget_above, lambda s: "largest K above smallest K (difference's 95% interval above 0)"
    ),
    "above_metric": ClaimKind(
        _above_metric, lambda s: f"each above {s['other_metric']} (paired differences' 95% intervals above 0)"
    ),
    "converges_within": ClaimKind(
        _converges_within,
        lambda s: (
            f"first sweep within {s['tolerance']} of the plateau (mean of the last {s['plateau_sweeps']} "
            f"sweeps) ≤ {s['sweeps']} (95% interval's upper end)"
        ),
    ),
}
CLAIM_KINDS = tuple(KINDS)


def _kind(spec: dict[str, Any], task: str = "?") -> ClaimKind:
    kind = spec["kind"]
    if kind not in KINDS:
        raise ValueError(f"claim {task}/{spec.get('id', '?')}: unknown kind {kind!r}; known: {CLAIM_KINDS}")
    return KINDS[kind]


def claim_target(spec: dict[str, Any]) -> str:
    """What a claim asks for, as printed in the claims table's ``target`` column."""
    return _kind(spec).target(spec)


def check_claim(
    spec: dict[str, Any],
    task: str,
    fin: pd.DataFrame,
    retrained: pd.DataFrame,
    curves: pd.DataFrame | None = None,
) -> ClaimResult:
    """Evaluate one claim of ``<task>.claims`` (pipeline/paper_numbers.yaml) on the final
    metrics ``fin`` of the main cells (and the ``retrained`` budget cells), by the rules
    in ``VERDICT_RULES``. ``curves``: the main cells' rows of every held-out set and sweep,
    for claims that name a ``test_set`` or look at sweeps (``falls_over_sweeps``)."""
    kind = _kind(spec, task)
    if "test_set" in spec:
        if curves is None or "test_set" not in curves:
            curves = pd.DataFrame(columns=["test_set", "method", "metric", "K", "L", "sweep", "cell_id"])
        curves = curves[curves["test_set"] == spec["test_set"]]
        fin = finals(curves)
    if "train" in spec:  # only the cells trained at this (K, L)
        k, l = spec["train"]
        fin = fin[(fin["train_K"] == k) & (fin["train_L"] == l)]
    # ``sweep``: the method's numbers after that sweep rather than its last (a budget that
    # matches another method's); the other method keeps its last sweep.
    mine = fin
    if spec.get("sweep") is not None:
        if spec["kind"] == "falls_over_sweeps":
            raise ValueError(f"claim {task}/{spec['id']}: a falls_over_sweeps claim takes no sweep")
        rows = curves if curves is not None and "sweep" in curves else fin.iloc[:0]
        mine = rows[rows["sweep"] == spec["sweep"]]
    return kind.check(Claim(spec, task, fin, mine, curves, retrained))


def task_claims(task: str, results: dict[str, Any], paper: dict[str, Any] | None) -> list[ClaimResult]:
    """Every claim of ``paper["claims"]`` checked on one task's evaluation rows (``load_results``)."""
    meta, everything = results["meta"], results["metrics"]
    all_sets = main_rows(everything, meta)
    frame = primary_test_set(all_sets, meta)
    retrained = retrained_rows(primary_test_set(everything, meta), meta)
    checked = []
    for spec in (paper or {}).get("claims") or []:
        result = check_claim(spec, task, finals(frame), finals(retrained), all_sets)
        checked.append(result._replace(departure=claim_departure(spec, result.value, paper)))
    return checked


def claims_not_run(task: str, specs: list[dict[str, Any]], why: str) -> list[ClaimResult]:
    """Claims of a task this run has no results for, listed so the table shows what was not checked."""
    blank = {"passed": None, "note": "not run", "value": None, "lo": None, "hi": None, "target_value": None}
    return [
        ClaimResult(task, s["id"], s["claim"], s.get("section", ""), why, claim_target(s), cells=(), **blank)
        for s in specs
    ]


def verdict(r: ClaimResult) -> str:
    if r.note:  # no verdict, and why: not run, too few seeds, at the ceiling
        return r.note
    return {True: "✓", False: "✗", None: "–"}[r.passed]


def claims_markdown(
    results: list[ClaimResult],
    flags: dict[str, str],
    unclaimed: list[str],
    replication: dict[str, ClaimResult] | None = None,
    replication_text: str | None = None,
) -> str:
    """The claims table with its verdict rules; a claim whose numbers come from a cell that
    has not plateaued carries that cell's mark. ``replication``: the same claims checked on
    the recorded second run (``{task/id: result}``), shown as a last column."""
    header = [
        "task",
        "claim (paper section)",
        "ours (95% interval over seeds)",
        "target",
        "detectable",
        "✓/✗",
    ]
    if replication is not None:
        header.append(f"✓/✗ [`{REPLICATION}`](recorded/{REPLICATION}/README.md)")
    rows = []
    marks, far = "", []
    for r in results:
        flag = row_flag(r.cells, flags)
        marks += flag
        section = f" ({r.section})" if r.section else ""
        smallest = number(r.detectable) if math.isfinite(r.detectable) else "n/a"
        ours = _flagged(r.ours, flag)
        if r.departure:  # more than 2x from the paper's own number: flagged, reason below
            far.append(f"- {FLAG}{len(far) + 1} {r.task}, {r.id}: {r.departure}.")
            ours = f"{ours} {FLAG}{len(far)}"
        row = [r.task, f"{r.claim}{section}", ours, r.target, smallest, verdict(r)]
        if replication is not None:
            other = replication.get(f"{r.task}/{r.id}")
            row.append(verdict(other) if other is not None else "not run")
        rows.append(row)
    lines = [markdown_table(header, rows)]
    lines += ["", f"Verdict rules: {VERDICT_RULES}"]
    if replication is not None:
        lines += ["", replication_text or replication_note()]
    if marks:
        lines += ["", flag_notes(marks)]
    if far:
        lines += ["", FLAG_RULE, "", *far]
    if unclaimed:
        lines += ["", f"No claims defined yet for: {', '.join(unclaimed)}."]
    return "\n".join(lines)


# The recorded second run of the defaults (``apg-pipeline record replicate``: other training
# seeds, ideally another CPU type): its verdicts stand beside the main run's.
REPLICATION = "replicate"


def replication_note(this_machine: str | None = None, replicate_machine: str | None = None) -> str:
    """The sentence under the claims table that says what its last column is, naming both
    runs' machines when known, and whether their CPUs differ (trained numbers differ across
    CPUs, so a replication on another CPU type tests more than one on the same)."""
    text = (
        f"The last column: the same claims on the recorded run `{REPLICATION}` (the defaults again, "
        "training seeds moved by 100"
    )
    if this_machine is None or replicate_machine is None:
        text += "; its machine is named in its report)."
    else:
        cpu = this_machine.split(" (")[0].split(",")[0]
        kind = "the same CPU type" if replicate_machine.startswith(cpu) else "a different CPU type"
        text += (
            f"), trained on {kind}: {replicate_machine.rstrip('.')}. This run: {this_machine.rstrip('.')}."
        )
    return text + " The headline counts the claims that hold in both runs."


def replication_machine(root: Path) -> str | None:
    """The machine line the recorded replication's manifest names (None without one)."""
    manifest = root / "recorded" / REPLICATION / "manifest.json"
    return json.loads(manifest.read_text()).get("machine") if manifest.is_file() else None


def replication_claims(
    root: Path, tasks: list[str], paper_all: dict[str, Any]
) -> dict[str, ClaimResult] | None:
    """``{task/id: result}`` of the main claims on the recorded replication, None without one."""
    run = root / "recorded" / REPLICATION
    if not run.is_dir():
        return None
    found: dict[str, ClaimResult] = {}
    for task in tasks:
        if (run / "eval" / task).is_dir():
            results = load_results(run / "eval" / task)
            found.update({f"{c.task}/{c.id}": c for c in task_claims(task, results, paper_all.get(task))})
    return found
