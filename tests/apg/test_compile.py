"""The training step compiled with ``torch.compile`` (issue 21, item 2).

``TrainConfig.compile`` compiles the step's sampler and loss with ``fullgraph=True`` (a
graph break is an error there), as a GPU trial runs it (with CUDA graphs). Dynamo's trace
alone (``torch._dynamo.explain``, no code generation) shows the breaks in seconds for every
task and method; one slow test compiles and trains for real.

Bouncing MNIST's step is too long to trace whole (K sweeps of T + 1 block updates), so it
compiles unit by unit (``Model.compile_per_block``, ``run_apg(compiled=True)``): the tests
count its graphs, check that a frame's update in its window is its update in the whole
video, and that the compiled step computes what the eager one does from the same draws.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from apg.baselines import METHODS
from apg.smc import sampler
from apg.smc.sampler import block_update, update_in_window
from apg.tasks import get_task
from apg.tasks.bmnist import BMNISTConfig, frame_log_likelihood
from apg.tasks.simulation import simulate_set
from apg.training import CompiledGradientsLost, TrainConfig, Trainer, build
from tests.pairs import accepted, runnable
from tests.support import REPO

SIZES = {"gmm": {"num_points": 12}, "dgmm": {"num_points": 24}}
NETWORK = {"bmnist": {"num_digits": 2}}


def data(task: str) -> torch.Tensor:
    if task == "bmnist":
        return torch.rand(4, 3, 96, 96)  # any frames will do for a trace
    return torch.as_tensor(simulate_set(task, {}, 4, 1, SIZES[task])["x"]).float()


def config(task: str, method: str, **kw) -> TrainConfig:
    sizes = {
        "sweeps": 2,
        "particles": 3,
        "batch_size": 2,
        "iterations": 1000,
        "lr": 1e-4,
        "network": NETWORK.get(task, {}),
        **kw,
    }
    return TrainConfig(task=task, method=method, **sizes)


def per_block(task: str, method: str) -> bool:
    """Whether a compiled trainer compiles the sampler unit by unit (``Trainer``'s rule)."""
    return get_task(task).build_model().compile_per_block and METHODS[method].kernels


# Every task with every method that accepts it, less those that refuse its model when built.
ACCEPTED = accepted(config)
CASES = runnable(config)
COMPILED = [(t, m) for t, m in CASES if METHODS[m].not_compiled_because is None]
WHOLE = [(t, m) for t, m in COMPILED if not per_block(t, m)]
PER_BLOCK = [(t, m) for t, m in COMPILED if per_block(t, m)]


def test_the_methods_that_need_more_of_a_model_refuse_it_when_built():
    """Bootstrapped Gibbs needs a prior over the globals (the GMM's alone); HMC-RWS and
    reparam need the discrete latents summed out (Bouncing MNIST has none to sum)."""
    refused = sorted(set(ACCEPTED) - set(CASES))
    assert refused == [
        ("bmnist", "gibbs-bootstrap"),
        ("bmnist", "hmc-rws"),
        ("bmnist", "reparam"),
        ("dgmm", "gibbs-bootstrap"),
    ]
    assert len(CASES) == 15


def test_bouncing_mnist_apg_compiles_per_block_and_the_rest_whole():
    assert PER_BLOCK == [("bmnist", "apg")]
    assert ("bmnist", "rws-mlp") in WHOLE  # no block updates: its step is short


@pytest.mark.parametrize("task,method", WHOLE)
def test_the_step_traces_into_one_graph(task, method):
    trainer = Trainer(config(task, method), data(task))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        explained = torch._dynamo.explain(trainer._loss_and_metrics)(trainer._next_batch())
    reasons = [
        f"{b.reason.splitlines()[0]} at {b.user_stack[-1] if b.user_stack else '?'}"
        for b in explained.break_reasons
    ]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


def test_methods_that_differentiate_inside_the_step_refuse_to_compile():
    not_compiled = sorted(m for m in METHODS if METHODS[m].not_compiled_because)
    assert not_compiled == ["avf", "hmc-rws"]
    with pytest.raises(ValueError, match="method 'hmc-rws' cannot be compiled: its leapfrog steps"):
        config("gmm", "hmc-rws", compile=True).validate()
    with pytest.raises(ValueError, match="compile must be true or false"):
        config("gmm", "apg", compile="yes").validate()


@pytest.mark.slow
def test_a_compiled_step_trains_and_compiles_once():
    # The smallest cell: inductor's code generation on CPU takes minutes for the paper's.
    torch._dynamo.reset()
    counters.clear()
    cfg = TrainConfig(
        task="gmm",
        method="rws-mlp",
        sweeps=1,
        particles=3,
        batch_size=2,
        iterations=4,
        network={"hidden": 4},
        compile=True,
        lr=1e-4,
    )
    trainer = Trainer(cfg, data("gmm"))
    before = [p.detach().clone() for p in trainer.proposals.parameters()]
    rows = list(trainer.run())
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert counters["stats"]["unique_graphs"] == 1  # traced once: no recompilation per step
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.proposals.parameters(), strict=True))


def test_the_video_likelihood_keeps_its_gradients_when_compiled():
    """torch 2.11's torch.compile silently zeroed the gradients of an autograd.Function whose
    output it had written in place, on any backend: on the GPU, Bouncing MNIST's decoder then
    never learnt. The likelihood's gradients, traced, are the eager ones."""
    gen = torch.Generator().manual_seed(0)
    templates = torch.rand(2, 3, 2, 28, 28, generator=gen).requires_grad_()  # (L, B, D, S, S)
    where = (torch.rand(2, 3, 2, 2, 2, generator=gen) * 1.6 - 0.8).requires_grad_()  # (L, B, F, D, 2)
    frames = torch.rand(3, 2, 96, 96, generator=gen)  # (B, F, H, H)

    def total(t, w):
        return frame_log_likelihood(frames, t, w, BMNISTConfig()).sum()

    eager = torch.autograd.grad(total(templates, where), (templates, where))
    traced = torch.compile(total, backend="aot_eager", fullgraph=True)
    compiled = torch.autograd.grad(traced(templates, where), (templates, where))
    for e, c in zip(eager, compiled, strict=True):  # round-off: the traced path pads its sums
        assert e.abs().sum() > 0
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4 * float(e.abs().max()))


def test_a_compiled_step_that_loses_a_gradient_stops_before_its_update():
    """A compiled trainer's first step checks its gradients against an eager step's on the
    same batch. Here the "compiled" step is the eager one with the decoder cut off, as torch
    2.11 ran Bouncing MNIST's: it stops there, naming the decoder, and no weight
    moves."""
    trainer = Trainer(config("bmnist", "rws-mlp", compile=True), videos(3))
    decoder = list(trainer.model.parameters())

    def without_the_decoder(x):
        for p in decoder:
            p.requires_grad_(False)
        try:
            return trainer._loss_and_metrics(x)
        finally:
            for p in decoder:
                p.requires_grad_(True)

    trainer._forward = without_the_decoder
    before = [p.detach().clone() for p in (*decoder, *trainer.proposals.parameters())]
    lost = rf"no gradient to {len(decoder)} of the {len(before)} parameters that the eager step trains \(model\.decoder"
    with pytest.raises(CompiledGradientsLost, match=lost):
        trainer.step()
    after = [*decoder, *trainer.proposals.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert trainer.iteration == 0


def test_the_gradient_check_leaves_the_trials_draws_as_they_were():
    """The check's eager step draws from forked random streams: a trainer whose compiled
    step is (here) the eager one trains exactly as an eager trainer does."""
    x = videos(3)
    rows = []
    for compile_ in (False, True):
        torch.manual_seed(5)
        trainer = Trainer(config("bmnist", "rws-mlp", compile=compile_), x)
        if compile_:
            trainer._forward = trainer._loss_and_metrics
        rows.append([trainer.step() for _ in range(2)])
        assert trainer._gradients_checked
    for eager, checked in zip(*rows, strict=True):
        for key in ("loss", "log_joint", "ess"):
            assert checked[key] == eager[key], key


def test_params_turn_compiling_on_per_task_or_per_grid_entry():
    import copy

    from pipeline.config.params import ParamsError, grid_cells, load_params, validate_params

    params = load_params(REPO / "params.yaml")
    on = copy.deepcopy(params)
    on["gmm"]["train"]["compile"] = True  # the gmm grid has HMC-RWS: its entry must say no
    with pytest.raises(ParamsError, match=r"gmm\.grid\[\d\]: method 'hmc-rws' cannot be compiled"):
        validate_params(on)
    eager_methods = set()
    for entry in on["gmm"]["grid"]:
        if "hmc-rws" in entry["methods"]:
            entry.setdefault("train", {})["compile"] = False
            eager_methods |= set(entry["methods"])
    validate_params(on)
    cells = grid_cells(on, "gmm")
    assert {c.method for c in cells if c.train.compile} == {c.method for c in cells} - eager_methods
    assert {"apg", "rws-mlp", "rws-lstm", "gibbs"} <= {c.method for c in cells if c.train.compile}
    # a compiled cell is another experiment (torch's random streams): another id; an eager
    # cell's id does not mention compiling, so it is the id it had before the option existed
    eager = {(c.method, c.sweeps, c.particles, c.seed): c.cell_id("d") for c in grid_cells(params, "gmm")}
    for c in cells:
        same = c.cell_id("d") == eager[c.method, c.sweeps, c.particles, c.seed]
        assert same != c.train.compile
    assert {c.method for c in cells if not c.train.compile} == eager_methods


def videos(num_frames: int) -> torch.Tensor:
    """Two sparse random videos: enough ink for every correlation map to have a peak."""
    gen = torch.Generator().manual_seed(num_frames)
    return torch.rand(2, num_frames, 96, 96, generator=gen) * (
        torch.rand(2, num_frames, 96, 96, generator=gen) < 0.1
    )


# Per video length: the block -> (its block in the window, the window's frames).
WINDOWS = {
    1: {"where_1": ("where_1", 1)},
    2: {"where_1": ("where_1", 2), "where_2": ("where_2", 2)},
    3: {"where_1": ("where_1", 2), "where_2": ("where_2", 3), "where_3": ("where_2", 2)},
    4: {
        "where_1": ("where_1", 2),
        "where_2": ("where_2", 3),
        "where_3": ("where_2", 3),
        "where_4": ("where_2", 2),
    },
}


@pytest.mark.parametrize("num_frames", sorted(WINDOWS))
def test_a_frames_update_in_its_window_is_its_update_in_the_whole_video(num_frames):
    model, proposals = build(config("bmnist", "apg"))
    x = videos(num_frames)
    torch.manual_seed(0)
    z, _ = proposals.initial(x, 3)
    blocks = model.blocks_for(x)
    windows = {}
    for block, names in blocks.items():
        torch.manual_seed(1)
        whole = block_update(model, proposals, block, names, x, z)
        torch.manual_seed(1)
        local = update_in_window(block_update, model, proposals, block, names, x, z)
        assert whole[0].keys() == local[0].keys() == set(names)
        for name in names:
            assert torch.equal(whole[0][name], local[0][name]), block
        assert whole[2] == local[2] == {}  # no caches
        for a, b in zip(whole[1::2], local[1::2], strict=True):  # the change, log q of new and old
            assert torch.equal(a, b), block
        window = model.block_window(block, x)
        if window is not None:
            windows[block] = (window.block, window.x.shape[1])
    assert windows == WINDOWS[num_frames]
    with pytest.raises(ValueError, match="block 'where_9' does not exist in a video of"):
        model.block_window("where_9", x)


def test_a_windowed_where_update_and_resampling_trace_without_breaks():
    """Dynamo's trace alone (seconds): a middle frame's update in its window, and resampling."""
    model, proposals = build(config("bmnist", "apg"))
    x = videos(4)
    z, _ = proposals.initial(x, 3)
    window = model.block_window("where_2", x)
    local = {here: z[there].contiguous() for here, there in window.names.items()}
    names = model.blocks_for(window.x)[window.block]
    torch._dynamo.reset()
    for fn, args in (
        (block_update, (model, proposals, window.block, names, window.x.contiguous(), local)),
        (sampler.resample, (torch.randn(3, 2), z, sampler.get_resampler("systematic"))),
    ):
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        assert explained.graph_count == 1


def compiled_against_eager(num_frames: int, steps: int, **train) -> tuple[list[tuple[dict, dict]], list]:
    """Metrics of ``steps`` training steps of an eager and a compiled APG trainer from the same
    seeds (the same draws: the compiled graphs run torch's random ops in the eager order), and
    the pairs of gradients of the first step. Dynamo's caches start empty, as in the other
    tracing tests here: graphs an earlier test compiled (another backend, another mode) are
    not this test's."""
    torch._dynamo.reset()
    x = videos(num_frames)
    rows, grads = [], []
    for compile_ in (False, True):
        torch.manual_seed(2)
        trainer = Trainer(config("bmnist", "apg", compile=compile_, lr=1e-3, **train), x)
        counters.clear()
        torch.manual_seed(3)
        rows.append([trainer.step()])
        params = [*trainer.model.parameters(), *trainer.proposals.parameters()]
        grads.append([p.grad.clone() for p in params if p.grad is not None])
        rows[-1] += [trainer.step() for _ in range(steps - 1)]
    return list(zip(*rows, strict=True)), list(zip(*grads, strict=True))


def assert_same_steps(pairs: list[tuple[dict, dict]], grads: list, rel: float, grad_rel: float) -> None:
    """Metrics within ``rel``; gradients (Adam's steps hide their scale, so they are compared
    too) within ``grad_rel`` of each tensor's largest entry: a sum of many float32 terms in
    another order moves its small entries by more than ``rel`` of themselves."""
    for eager, compiled in pairs:
        for key in ("loss", "log_joint", "ess", "log_evidence"):
            assert compiled[key] == pytest.approx(eager[key], rel=rel, abs=1e-5), key
    assert grads and all(e.shape == c.shape for e, c in grads)
    for eager, compiled in grads:
        torch.testing.assert_close(compiled, eager, rtol=grad_rel, atol=grad_rel * float(eager.abs().max()))


# Graphs of a compiled APG step: the initial step, resampling (twice: the encoder's positions
# are views before the first one), what, and where at the first, a middle and the last frame.
# Without resampling, what is traced twice instead (views at the first sweep).
GRAPHS = {"block": 7, "none": 6}


@pytest.mark.slow
@pytest.mark.parametrize("resample_mode,lengths,sweeps", [("block", (4, 6), 2), ("none", (5,), 3)])
def test_a_per_block_step_traces_unit_by_unit(resample_mode, lengths, sweeps, monkeypatch):
    """Traced with aot_eager (the traced ops, run as they are: no code generation; a
    minute): fullgraph, as many graphs for videos of 4 and 6 frames, none traced again at
    later steps, and the eager step's numbers and gradients."""
    monkeypatch.setattr(
        sampler, "compiled_units", functools.partial(sampler.compiled_units, backend="aot_eager")
    )
    for num_frames in lengths:
        pairs, grads = compiled_against_eager(num_frames, 3, resample_mode=resample_mode, sweeps=sweeps)
        assert counters["stats"]["unique_graphs"] == GRAPHS[resample_mode], num_frames
        assert not counters["graph_break"]
        # Three Adam steps carry the first step's reordered float32 sums into the next:
        # without resampling the third step's loss differed by 1.3e-4 of itself on an Intel
        # Xeon with AVX-512 (2026-11-28, torch 2.13.0+cpu), by less on other CPUs. Without
        # resampling, 3 sweeps chain more reordered sums into the first step's gradients: at
        # one torch thread on an AMD EPYC (2026-12-07, torch 2.13.0+cpu) 3 of 2,000 entries of
        # one tensor differed by up to 1.7e-3 of its largest entry.
        assert_same_steps(pairs, grads, rel=5e-4, grad_rel=1e-3 if resample_mode == "block" else 2.5e-3)


def test_the_per_block_graphs_take_cuda_graphs_on_a_gpu_and_not_on_a_cpu(monkeypatch):
    """``run_apg(compiled=True)`` asks for CUDA graphs by its data's device, and
    ``compiled_units`` compiles each unit with ``mode="reduce-overhead"`` exactly then."""
    modes: list = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: modes.append(kw["mode"]) or fn)
    sampler.compiled_units.cache_clear()
    try:
        sampler.compiled_units(cuda_graphs=True)
        sampler.compiled_units()
    finally:
        sampler.compiled_units.cache_clear()
    assert modes == ["reduce-overhead"] * 3 + [None] * 3

    asked: list = []
    monkeypatch.setattr(sampler, "compiled_units", lambda **kw: asked.append(kw) or sampler._UNITS)
    trainer = Trainer(config("bmnist", "apg", compile=True), videos(3))
    trainer.step()
    assert asked and all(kw == {"cuda_graphs": False} for kw in asked)


def test_a_method_without_compiled_units_refuses_per_block_compiling(monkeypatch):
    monkeypatch.setattr(type(METHODS["apg"]), "supports_compiled_units", False)
    with pytest.raises(ValueError, match="method 'apg' cannot be compiled on task 'bmnist'"):
        Trainer(config("bmnist", "apg", compile=True), videos(3))


@pytest.mark.slow
def test_a_per_block_step_compiles_with_inductor_and_computes_the_eager_step(monkeypatch):
    """inductor's generated code, with its random ops falling back to torch's (its own
    Philox streams would draw other numbers): the same numbers as the eager step, to
    float32 round-off."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    pairs, grads = compiled_against_eager(3, 2)
    assert counters["stats"]["unique_graphs"] == GRAPHS["block"]
    assert_same_steps(pairs, grads, rel=1e-4, grad_rel=1e-3)
