"""pipeline/statistics.py against scipy's own tests and intervals."""

import math

import numpy as np
import pytest
from scipy import stats

from pipeline import statistics as st

SAMPLES = [
    ([1.0, 2.0, 3.5], [0.1, 0.4, 0.2, 0.9]),
    ([-275.2, -274.1, -276.0, -275.5, -274.9], [-275.0, -276.3, -274.4]),
    ([0.49, 0.51, 0.47, 0.52, 0.50, 0.48], [0.50, 0.49, 0.515, 0.47, 0.505]),
]


def test_quantiles_are_scipys():
    assert st.t975(2) == pytest.approx(4.302653, abs=1e-6)
    for df in (1, 3, 4.6, 30, 200):
        assert st.t975(df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-12)
    with pytest.raises(ValueError, match="df must be > 0"):
        st.t_quantile(0.9, 0)


def test_seed_interval_is_the_student_t_interval():
    for values, _ in SAMPLES:
        e = st.seed_interval(values)
        lo, hi = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
        assert (e.mean, e.lo, e.hi, e.n) == pytest.approx((np.mean(values), lo, hi, len(values)))
    two = st.seed_interval([1.0, 2.0, float("nan")])
    assert two.n == 2 and math.isnan(two.lo) and math.isnan(two.se)


def test_difference_is_welchs_interval():
    for a, b in SAMPLES:
        d = st.difference(st.seed_interval(a), st.seed_interval(b))
        welch = stats.ttest_ind(a, b, equal_var=False)
        ci = welch.confidence_interval(0.95)
        assert (d.lo, d.hi, d.df) == pytest.approx((ci.low, ci.high, welch.df))
    assert math.isnan(st.difference(st.seed_interval([1.0]), st.seed_interval(SAMPLES[0][1])).lo)


def test_equivalence_is_two_one_sided_welch_tests():
    rng = np.random.default_rng(0)
    decided = []
    for _ in range(200):
        n, m = rng.integers(3, 8, size=2)
        a, b = rng.normal(0, 1, n), rng.normal(rng.normal(0, 0.8), 1, m)
        margin = float(rng.uniform(0.3, 3.0))
        lower = stats.ttest_ind(a + margin, b, equal_var=False, alternative="greater").pvalue
        upper = stats.ttest_ind(a - margin, b, equal_var=False, alternative="less").pvalue
        d = st.difference(st.seed_interval(a), st.seed_interval(b))
        assert st.equivalent(d, margin) == (max(lower, upper) < 0.05)
        decided.append(st.equivalent(d, margin))
    assert 0 < sum(decided) < len(decided)  # both outcomes occurred: the check has teeth
    assert (
        st.equivalent(st.difference(st.seed_interval([1.0]), st.seed_interval([2.0, 3.0, 4.0])), 1.0) is None
    )


def test_detectable_effect_has_its_power_under_the_noncentral_t():
    for values, _ in SAMPLES:
        e = st.seed_interval(values)
        delta = st.detectable(e)
        t = stats.t.ppf(0.975, e.df)
        power = stats.nct.sf(t, e.df, delta / e.se) + stats.nct.cdf(-t, e.df, delta / e.se)
        # (t_0.975 + t_0.8) SE is the usual approximation: within 0.035 of 80% at 2 or more df
        assert power == pytest.approx(st.POWER, abs=0.035)
    assert math.isnan(st.detectable(st.seed_interval([1.0, 2.0])))
