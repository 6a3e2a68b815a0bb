"""The native kernels as registered ops (``apg/kernels/ops.py``): every op passes
``torch.library.opcheck`` on both of its CPU paths (the C function and the PyTorch twin),
with and without gradients where it has autograd; compiled graphs can hold one; and no
module outside ``apg/kernels/`` reaches a C function but through an op."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

import apg.distributions  # noqa: F401 - each module registers its ops on import
import apg.nn  # noqa: F401
import apg.random  # noqa: F401
import apg.smc.resampling  # noqa: F401
import apg.tasks.dgmm.distributions  # noqa: F401
import apg.tasks.dgmm.model  # noqa: F401
import apg.tasks.dgmm.proposals  # noqa: F401
import apg.tasks.gmm.conjugate  # noqa: F401
import apg.tasks.gmm.model  # noqa: F401
import apg.tasks.gmm.proposals  # noqa: F401
from apg.kernels.ops import REGISTRY
from tests.support import REPO

ROOT = REPO


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _positive(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, dtype=torch.float64) + 0.5


def _gmm(two: bool = True) -> tuple:
    """GMM data (B=2, N=7, D=2), globals (L=3, I=3) and assignments."""
    c = torch.randint(0, 3, (3, 2, 7))
    return (
        _randn(2, 7, 2),
        c,
        _randn(3, 2, 3, 2),
        _positive(3, 2, 3, 2),
        _randn(3, 2, 3, 2),
        _positive(3, 2, 3, 2),
        two,
    )


def _gmm_assignment() -> tuple:
    """Data, globals and the assignment network's first four weights (H=8)."""
    x, _, mu, tau, *_ = _gmm()
    return x, mu, tau, _randn(8, 2), _randn(8), _randn(8, 2), _randn(1, 8)


def _gmm_soft_moments() -> tuple:
    """Data, assignments and the globals kernel's heads (I=3 and D=2 outputs of D + I inputs)."""
    x, c, *_ = _gmm()
    return x, c, _randn(3, 5), _randn(3), _randn(2, 5), _randn(2)


def _with_lse(logits: torch.Tensor, index: torch.Tensor) -> tuple:
    """Rows' logits and indices with the rows' log-normalizers (a draw's)."""
    return logits, index, torch.logsumexp(logits, -1)


PRIOR = (2.0, 2.0, 0.3, 0.0)  # the GMM's (alpha0, beta0, nu0, mu0)


def _normal_gamma() -> tuple:
    """NormalGamma parameters ``(m, nu, alpha, beta)`` (L=3, B=2, I=3, D=2; nu and alpha
    shared by the dimensions, as the conjugate update gives them) and values ``(mu, tau)``."""
    return (
        _randn(3, 2, 3, 2),
        _positive(3, 2, 3, 1),
        _positive(3, 2, 3, 1) + 1,
        _positive(3, 2, 3, 2),
        _randn(3, 2, 3, 2),
        _positive(3, 2, 3, 2),
    )


def _sums(per_particle: bool = True) -> torch.Tensor:
    """Per-cluster sums ``(sum r, sum r t, sum r t^2)`` of soft assignments (I=3, D=2)."""
    resp = torch.softmax(torch.randn(3, 2, 9, 3, dtype=torch.float64), -1)
    stats = _randn(3, 2, 9, 2)
    moments = torch.cat([torch.ones_like(stats[..., :1]), stats, stats * stats], -1)
    sums = resp.transpose(-1, -2) @ moments
    return sums if per_particle else sums[0].clone()


def _ring() -> tuple:
    """Rings data ``x (B=2, N=7, 2)``, centres ``(L=3, B, I=4, 2)``, assignments and shapes."""
    return _randn(2, 7, 2), _randn(3, 2, 4, 2), torch.randint(0, 4, (3, 2, 7)), _randn(3, 2, 7, 2)


def _local() -> tuple:
    """The rings' local proposal: ``params (L=3, B=2, N=5, I=4, 4)``, assignments and angles."""
    return _randn(3, 2, 5, 4, 4), torch.randint(0, 4, (3, 2, 5)), torch.rand(3, 2, 5, dtype=torch.float64) * 6


def _local_net() -> tuple:
    """The rings' local network: data, centres, the first layer's parts (H=8), output and
    skip weights."""
    x, mu = _randn(2, 5, 2), _randn(3, 2, 4, 2)
    return x, mu, _randn(2, 5, 8), _randn(3, 2, 4, 8), _randn(4, 8), _randn(4), _randn(4, 5)


# Small inputs of the sizes the models use, per op: () -> args. Ops with autograd are
# checked again with every floating input requiring its gradient (GRAD_ARGS: which).
SAMPLES: dict[str, Callable[[], tuple]] = {
    "pairwise_tanh_linear": lambda: (_randn(2, 5, 4), _randn(3, 2, 6, 4), _randn(4, 3)),
    "pairwise_tanh_linear_backward": lambda: (
        _randn(3, 2, 5, 4),
        _randn(3, 2, 6, 4),
        _randn(4, 3),
        _randn(3, 2, 5, 6, 3),
    ),
    "scaled_pairwise_tanh_linear": lambda: (
        _randn(2, 5, 3),
        _randn(3, 2, 4, 3, 6),
        _randn(3, 2, 4, 6),
        _randn(6),
    ),
    "scaled_pairwise_tanh_linear_backward": lambda: (
        _randn(2, 5, 3),
        _randn(3, 2, 4, 3, 6),
        _randn(3, 2, 4, 6),
        _randn(6),
        _randn(3, 2, 5, 4),
    ),
    "tanh_mlp": lambda: (_randn(3, 4, 2), _randn(8, 2), _randn(8), _randn(5, 8), _randn(5), False),
    "tanh_mlp_backward": lambda: (
        _randn(3, 4, 2),
        _randn(8, 2),
        _randn(8),
        _randn(5, 8),
        _randn(3, 4, 5),
        True,
        False,
    ),
    "systematic_resample": lambda: (_randn(5, 3), torch.rand(3, 1, dtype=torch.float64)),
    "systematic_resample_gather": lambda: (
        _randn(5, 3),
        torch.rand(3, 1, dtype=torch.float64),
        [_randn(5, 3, 2), torch.randint(0, 9, (5, 3, 4)), _randn(5, 3)],
    ),
    "gmm_assignment_change": lambda: (
        _randn(2, 7, 2),
        _randn(3, 2, 3, 2),
        _positive(3, 2, 3, 2),
        torch.randint(0, 3, (3, 2, 7)),
        torch.randint(0, 3, (3, 2, 7)),
    ),
    "gmm_log_globals": lambda: (*_gmm(), 0.0, 0.3, 2.0, 2.0),
    "gmm_assignment_logits": lambda: (*_gmm_assignment(), _randn(1)),
    "gmm_assignment_logits_backward": lambda: (
        *_gmm_assignment()[:3],
        _randn(1, 2, 7, 8),
        _randn(3, 2, 3, 8),
        _randn(1, 8),
        _randn(3, 2, 7, 3),
    ),
    "gmm_soft_moments": lambda: _gmm_soft_moments(),
    "gmm_soft_moments_backward": lambda: (*_gmm_soft_moments(), _randn(3, 2, 3, 5)),
    "philox_uniform": lambda: (12345, [3, 5], torch.float64, torch.device("cpu")),
    "philox_standard_gamma": lambda: (-987, _positive(4, 3)),
    "categorical_sample": lambda: (_randn(3, 4, 5), torch.rand(3, 4, dtype=torch.float64)),
    "categorical_log_prob": lambda: (_randn(3, 4, 5), torch.randint(0, 5, (3, 4))),
    "categorical_log_prob_backward": lambda: (_randn(3, 4, 5), torch.randint(0, 5, (3, 4)), _randn(3, 4)),
    "categorical_sample_rows": lambda: (_randn(3, 4, 5), 77),
    "categorical_rows_log_prob": lambda: (_randn(3, 4, 5), torch.randint(0, 5, (3, 4)), None),
    "categorical_rows_log_prob_backward": lambda: (
        _randn(3, 4, 5),
        torch.randint(0, 5, (3, 4)),
        None,
        _randn(3),
    ),
    "categorical_propose_rows": lambda: (_randn(3, 4, 5), torch.randint(0, 5, (3, 4)), -5),
    "gmm_ng_log_prob": lambda: _normal_gamma(),
    "gmm_ng_log_prob_backward": lambda: (*_normal_gamma(), _randn(3, 2)),
    "gmm_ng_sums_sample": lambda: (_sums(), _randn(3, 2, 3, 2), 11, *PRIOR),
    "gmm_ng_sums_log_prob": lambda: (_sums(), _randn(3, 2, 3, 2), _positive(3, 2, 3, 2), *PRIOR),
    "gmm_ng_sums_log_prob_backward": lambda: (
        _sums(),
        _randn(3, 2, 3, 2),
        _positive(3, 2, 3, 2),
        _randn(3, 2),
        *PRIOR,
    ),
    "gmm_ng_sums_propose": lambda: (
        _sums(),
        _randn(3, 2, 3, 2),
        _positive(3, 2, 3, 2),
        _randn(3, 2, 3, 2),
        3,
        *PRIOR,
    ),
    "ring_residuals": lambda: _ring(),
    "ring_residuals_backward": lambda: (*_ring(), _randn(3, 2)),
    "ring_residuals_change": lambda: (*_ring(), *_ring()[1:]),
    "von_mises": lambda: (_randn(12), _positive(12) * 3, 21, 2),
    "local_sample": lambda: (_randn(3, 2, 5, 4, 4), torch.rand(3, 2, 5, dtype=torch.float64)),
    "local_log_prob": lambda: _local(),
    "local_log_prob_backward": lambda: (*_local(), _randn(3, 2, 5)),
    "centre_pool": lambda: (_randn(3, 2, 7, 4), _randn(2, 7, 2), torch.randint(0, 4, (3, 2, 7)), 4),
    "centre_pool_backward": lambda: (
        _randn(3, 2, 7, 4),
        _randn(2, 7, 2),
        torch.randint(0, 4, (3, 2, 7)),
        _randn(3, 2, 4, 4),
    ),
    "local_net": lambda: (*_local_net(), 0.1),
    "local_net_backward": lambda: (*_local_net(), _randn(3, 2, 5, 4, 4), 0.1),
}
EXTRA_SAMPLES: dict[str, list[Callable[[], tuple]]] = {
    "gmm_ng_sums_sample": [lambda: (_sums(False), _randn(3, 2, 3, 2), 12, *PRIOR)],
    "gmm_ng_sums_log_prob": [lambda: (_sums(False), _randn(3, 2, 3, 2), _positive(3, 2, 3, 2), *PRIOR)],
    "gmm_ng_sums_propose": [
        lambda: (_sums(False), _randn(3, 2, 3, 2), _positive(3, 2, 3, 2), _randn(3, 2, 3, 2), 4, *PRIOR)
    ],
    "categorical_rows_log_prob": [lambda: _with_lse(_randn(2, 6, 3), torch.randint(0, 3, (2, 6)))],
    "categorical_rows_log_prob_backward": [
        lambda: (*_with_lse(_randn(2, 6, 3), torch.randint(0, 3, (2, 6))), _randn(2))
    ],
    "philox_uniform": [lambda: (2**62, [7], torch.float32, torch.device("cpu"))],
    "philox_standard_gamma": [lambda: (5, torch.rand(2, 5) * 0.5 + 0.01)],
    "gmm_log_globals": [lambda: (*_gmm(two=False), 0.0, 0.3, 2.0, 2.0)],
    "pairwise_tanh_linear": [lambda: (_randn(3, 2, 5, 4), _randn(3, 2, 6, 4), _randn(4, 1))],
    "tanh_mlp": [lambda: (_randn(3, 4), _randn(8, 2), _randn(8), _randn(5, 8), _randn(5), True)],
    "tanh_mlp_backward": [
        lambda: (_randn(3, 4), _randn(8, 2), _randn(8), _randn(5, 8), _randn(3, 4, 5), False, True)
    ],
}
# the inputs an op differentiates (the others take no gradient through it)
GRAD_ARGS: dict[str, tuple[int, ...]] = {
    "local_net": (2, 3, 4, 5, 6),
    "local_log_prob": (0,),
    "centre_pool": (0,),
    "ring_residuals": (3,),
    "ring_residuals_change": (3, 6),
    "gmm_ng_sums_propose": (0,),
    "categorical_log_prob": (0,),
    "categorical_rows_log_prob": (0,),
    "categorical_propose_rows": (0,),
    "scaled_pairwise_tanh_linear": (1, 2, 3),
    "gmm_assignment_logits": (3, 4, 5, 6, 7),
    "gmm_soft_moments": (2, 3, 4, 5),
}


def test_every_registered_op_has_samples():
    assert set(REGISTRY) == set(SAMPLES)


def _cases() -> list[tuple[str, Callable[[], tuple]]]:
    return [(name, make) for name in SAMPLES for make in [SAMPLES[name], *EXTRA_SAMPLES.get(name, [])]]


@pytest.mark.parametrize(("name", "make"), _cases(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_opcheck(kernel_path, name, make, grad):
    op = REGISTRY[name]
    if grad and op.backward is None:
        pytest.skip("no autograd")
    args = list(make())
    if grad:
        wanted = GRAD_ARGS.get(name, range(len(args)))
        args = [
            a.requires_grad_() if i in wanted and isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)
        ]
    torch.library.opcheck(op.op, tuple(args))


@pytest.mark.parametrize("name", ["pairwise_tanh_linear", "tanh_mlp"])
def test_the_native_path_equals_the_registered_op_values_and_gradients(name):
    """Eagerly an op's call skips the dispatcher (apg/kernels/ops.py); it computes what the
    registered op computes, bit for bit."""
    op = REGISTRY[name]
    args = [a.float().requires_grad_() if isinstance(a, torch.Tensor) else a for a in SAMPLES[name]()]
    results = []
    for fn in (op, op.op):
        out = fn(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        results.append([out, *torch.autograd.grad(out.sum(), tensors)])
    for eager, registered in zip(*results, strict=True):
        assert torch.equal(eager, registered)


@pytest.mark.parametrize("name", [n for n in SAMPLES if REGISTRY[n].backward is not None])
def test_the_registered_gradients_are_the_twins(kernel_path, name):
    """The registered autograd (the backward op, C or twin) gives the gradients that
    autograd computes through the PyTorch twin."""
    op = REGISTRY[name]
    for make in [SAMPLES[name], *EXTRA_SAMPLES.get(name, [])]:
        args = list(make())
        wanted = [i for i in GRAD_ARGS.get(name, range(len(args))) if isinstance(args[i], torch.Tensor)]
        for i in wanted:
            args[i].requires_grad_()
        inputs = [args[i] for i in wanted]
        outs, twins = op.op(*args), op.twin(*args)
        if isinstance(outs, torch.Tensor):
            outs, twins = (outs,), (twins,)
        for a, b in zip(outs, twins, strict=True):
            assert torch.allclose(a.double(), b.double())
        out, twin = outs[0], twins[0]  # the differentiable output first
        weights = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, weights)
        expected = torch.autograd.grad(twin, inputs, weights)
        for g, e in zip(got, expected, strict=True):
            assert torch.allclose(g, e), name


def test_a_compiled_graph_holds_an_op():
    point, cluster, weight = SAMPLES["pairwise_tanh_linear"]()
    compiled = torch.compile(torch.ops.apg.pairwise_tanh_linear, fullgraph=True, backend="aot_eager")
    assert torch.allclose(
        compiled(point, cluster, weight), REGISTRY["pairwise_tanh_linear"].twin(point, cluster, weight)
    )


def test_native_function_is_called_only_inside_apg_kernels():
    callers = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "apg").rglob("*.py")
        if "kernels" not in path.relative_to(ROOT / "apg").parts
        and re.search(r"\bnative_function\b", path.read_text())
    }
    assert callers == set()
