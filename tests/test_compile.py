"""The training step as one ``torch.compile`` graph (issue 21, item 2).

``TrainConfig.compile`` compiles the step's sampler and loss with ``fullgraph=True`` (a
graph break is an error there), as a GPU trial runs it (with CUDA graphs). Dynamo's trace
alone (``torch._dynamo.explain``, no code generation) shows the breaks in seconds for every
task and method; one slow test compiles and trains for real.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from apg.baselines import METHODS
from apg.tasks import get_task, task_names
from apg.training import TrainConfig, Trainer, make_method
from pipeline.generate import simulate_set

SIZES = {"gmm": {"num_points": 12}, "dgmm": {"num_points": 24}}
NETWORK = {"bmnist": {"num_digits": 2}}


def data(task: str) -> torch.Tensor:
    if task == "bmnist":
        return torch.rand(4, 3, 96, 96)  # any frames will do for a trace
    return torch.as_tensor(simulate_set(task, {}, 4, 1, SIZES[task])["x"]).float()


def config(task: str, method: str, **kw) -> TrainConfig:
    return TrainConfig(
        task=task, method=method, sweeps=2, particles=3, batch_size=2, network=NETWORK.get(task, {}), **kw
    )


def runs_on(task: str, method: str) -> bool:
    try:
        make_method(config(task, method)).check_task(get_task(task))
        return True
    except ValueError:
        return False


CASES = [(t, m) for t in task_names() for m in METHODS if runs_on(t, m)]
COMPILED = [(t, m) for t, m in CASES if METHODS[m].not_compiled_because is None]


@pytest.mark.parametrize("task,method", COMPILED)
def test_the_step_traces_into_one_graph(task, method):
    try:
        trainer = Trainer(config(task, method), data(task))
    except ValueError as err:  # the method cannot run this task's model
        pytest.skip(str(err))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        explained = torch._dynamo.explain(trainer._loss_and_metrics)(trainer._next_batch())
    reasons = [f"{b.reason.splitlines()[0]} at {b.user_stack[-1] if b.user_stack else '?'}" for b in explained.break_reasons]
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
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = TrainConfig(
        task="gmm", method="rws-mlp", sweeps=1, particles=3, batch_size=2, iterations=4, network={"hidden": 4}, compile=True
    )
    trainer = Trainer(cfg, data("gmm"))
    before = [p.detach().clone() for p in trainer.proposals.parameters()]
    rows = list(trainer.run())
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert counters["stats"]["unique_graphs"] == 1  # traced once: no recompilation per step
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.proposals.parameters(), strict=True))


def test_params_turn_compiling_on_per_task_or_per_grid_entry():
    import copy
    from pathlib import Path

    from pipeline.config import ParamsError, grid_cells, load_params, validate_params

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
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
