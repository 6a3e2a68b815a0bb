"""The numerics fingerprint (apg/fingerprint.py): what a cell's training computes, not its source.

The fingerprints of edited copies of the package are taken in a child process that imports
the copy, so the edits are real edits of the code, not monkeypatches.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import apg
from apg import fingerprint as fp
from apg.tasks import get_task
from apg.training import TrainConfig

PACKAGE = Path(apg.__file__).parent
# Small configs of two tasks and two methods each: what the copies are fingerprinted on.
CONFIGS = [("gmm", "apg"), ("gmm", "rws-mlp"), ("dgmm", "apg"), ("dgmm", "rws-mlp")]
SIZES = {"gmm": {"num_points": 20}, "dgmm": {"num_points": 24}}
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, apg
from apg.fingerprint import fingerprint
from apg.tasks import get_task
from apg.training import TrainConfig
out = {"package": apg.__file__}
for task, method in json.loads(sys.argv[2]):
    spec = get_task(task)
    sizes = json.loads(sys.argv[3])[task]
    x = spec.simulate(spec.build_model(), 2, torch.Generator().manual_seed(0), **sizes)["x"]
    cfg = TrainConfig(task=task, method=method, sweeps=2, particles=3, batch_size=2, iterations=3,
                      lr=0.01, network={"hidden": 8})
    out[task + "/" + method] = fingerprint(cfg, x)
print(json.dumps(out))
"""


def config(task: str = "gmm", method: str = "apg", **kwargs) -> TrainConfig:
    small = dict(sweeps=2, particles=3, batch_size=2, iterations=3, lr=0.01, network={"hidden": 8})
    return TrainConfig(task=task, method=method, **{**small, **kwargs})


def data(task: str = "gmm") -> torch.Tensor:
    spec = get_task(task)
    return spec.simulate(spec.build_model(), 2, torch.Generator().manual_seed(0), **SIZES[task])["x"]


def fingerprints_of_copy(tmp_path: Path, edit=None, env: dict | None = None) -> dict[str, str]:
    """The fingerprints of ``CONFIGS`` computed by a copy of the package, edited by ``edit(root)``."""
    root = tmp_path / "copy"
    shutil.copytree(PACKAGE, root / "apg", ignore=shutil.ignore_patterns("__pycache__"))
    if edit is not None:
        edit(root / "apg")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), json.dumps(CONFIGS), json.dumps(SIZES)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, **(env or {})},
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out.pop("package")).parent == root / "apg"  # the copy ran, not the installed package
    return out


def replace_in(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= count, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def test_a_fingerprint_is_repeatable_and_leaves_the_callers_draws_and_threads_alone():
    cfg, x = config(), data()
    threads = torch.get_num_threads()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = fp.fingerprint(cfg, x)
    assert torch.equal(torch.rand(3), expected)  # the caller's stream goes on as if nothing ran
    assert torch.get_num_threads() == threads
    assert fp.fingerprint(cfg, x) == first
    assert re.fullmatch(r"[0-9a-f]{12}", first)


def test_what_the_fingerprint_cuts_does_not_change_it_and_what_it_keeps_does():
    x = data()
    base = fp.fingerprint(config(), x)
    # cut: the steps, the batch, sweeps beyond MAX_SWEEPS, the compile flag (its own check)
    assert fp.fingerprint(config(iterations=9000, batch_size=20), x) == base
    deep = config(sweeps=fp.MAX_SWEEPS)
    assert fp.fingerprint(deep, x) == fp.fingerprint(config(sweeps=fp.MAX_SWEEPS + 7), x)
    # kept: anything that selects or feeds the computation
    for changed in (
        config(particles=4),
        config(lr=0.02),
        config(method="rws-mlp"),
        config(network={"hidden": 16}),
        config(resampler="multinomial"),
        config(sweeps=1),
    ):
        assert fp.fingerprint(changed, x) != base, changed
    assert fp.fingerprint(config(), data("gmm") + 1e-2) != base  # and the datasets


def test_the_numbers_are_each_steps_loss_metrics_and_gradient_norm_rounded():
    assert fp.rounded(1234.5678) == "1.235e+03"
    assert fp.rounded(1234.5678 * (1 + 1e-6)) == fp.rounded(1234.5678)
    assert fp.rounded(float("nan")) == "nan"
    got = fp.numbers(config(), data())
    steps = [(name, v) for name, v in got if name[0].isdigit()]
    assert {name.split("/", 1)[1] for name, _ in steps} == {
        "loss",
        "log_joint",
        "ess",
        "log_evidence",
        "grad_norm",
    }
    assert len({name.split("/")[0] for name, _ in steps}) == fp.STEPS
    assert all(value != 0 for name, value in steps if name.endswith("grad_norm"))
    named = dict(got)
    assert named["lr/0"] == named["lr/end"] == 0.01 and named["optimizer/betas/1"] == 0.99


def test_the_schedule_the_seeding_and_the_resume_path_are_part_of_the_numbers(monkeypatch):
    import apg.training

    x, cosine = data(), config(lr_schedule="cosine", iterations=1000)
    base = fp.fingerprint(cosine, x)
    assert fp.fingerprint(config(lr_schedule="cosine", iterations=2000), x) != base  # its real length
    assert fp.fingerprint(cosine, x, start=lambda seed: torch.manual_seed(seed + 1)) != base
    schedule = apg.training.learning_rate
    monkeypatch.setattr(
        apg.training, "learning_rate", lambda cfg, i: schedule(cfg, i) * (1.01 if i > 500 else 1)
    )
    assert fp.fingerprint(cosine, x) != base  # a change past the shrunk run's own steps
    monkeypatch.undo()
    restore = apg.training.Trainer.load_state_dict

    def forgets_the_optimizer(self, state):
        restore(self, {**state, "optimizer": self.optimizer.state_dict()})

    monkeypatch.setattr(apg.training.Trainer, "load_state_dict", forgets_the_optimizer)
    assert fp.fingerprint(cosine, x) != base  # a resume that loses Adam's moments


def test_perturbing_one_network_changes_the_fingerprints_of_the_methods_that_use_it(monkeypatch):
    import apg.training

    x = data()
    before = {m: fp.fingerprint(config(method=m), x) for m in ("apg", "rws-mlp")}
    build = apg.training.build

    def perturbed(cfg, device="cpu"):
        model, proposals = build(cfg, device)
        if cfg.method == "apg":  # one layer of APG's assignment network (not in RWS's), off by 0.01
            with torch.no_grad():
                dict(proposals.named_parameters())["assign.offset.weight"].add_(0.01)
        return model, proposals

    monkeypatch.setattr(apg.training, "build", perturbed)
    after = {m: fp.fingerprint(config(method=m), x) for m in ("apg", "rws-mlp")}
    assert after["apg"] != before["apg"]
    assert after["rws-mlp"] == before["rws-mlp"]


def rename_move_and_comment(root: Path) -> None:
    """A refactor that computes the same: two functions renamed everywhere (the sampler, used
    across the package, and one of its helpers), one moved within its module, a comment added
    to every file."""
    for path in root.rglob("*.py"):
        text = re.sub(r"\bblock_update\b", "update_one_block", path.read_text())
        text = re.sub(r"\brun_apg\b", "run_population_gibbs", text)
        path.write_text(f"# a comment a refactor added\n{text}")
    resampling = root / "smc" / "resampling.py"
    text = resampling.read_text()
    start = text.index("def _flat_index(")
    end = text.index("\ndef ", start + 1)
    resampling.write_text(text[:start] + text[end + 1 :] + "\n\n" + text[start:end])


@pytest.mark.slow
def test_renaming_moving_and_commenting_code_keeps_every_fingerprint(tmp_path):
    assert fingerprints_of_copy(tmp_path / "a") == fingerprints_of_copy(
        tmp_path / "b", rename_move_and_comment
    )


@pytest.mark.slow
def test_a_change_in_one_tasks_arithmetic_changes_only_that_tasks_fingerprints(tmp_path):
    def edit(root: Path) -> None:
        # the GMM's log joint off by one part in a thousand: a bug a refactor could bring
        replace_in(root / "tasks" / "gmm" / "model.py", "def log_joint(", "def _exact_log_joint(")
        replace_in(
            root / "tasks" / "gmm" / "model.py",
            "\n    def _exact_log_joint(",
            "\n    def log_joint(self, *args, **kwargs):\n"
            "        return 1.001 * self._exact_log_joint(*args, **kwargs)\n\n"
            "    def _exact_log_joint(",
        )

    before, after = fingerprints_of_copy(tmp_path / "a"), fingerprints_of_copy(tmp_path / "b", edit)
    assert {k for k in before if before[k] != after[k]} == {"gmm/apg", "gmm/rws-mlp"}


@pytest.mark.slow
def test_perturbing_one_native_kernel_changes_the_fingerprints_of_the_task_that_runs_it(tmp_path):
    """The rings' kernel concentration floor, doubled in the C source (the copy builds its own
    kernels): the rings' fingerprints change, the GMM's, whose kernels are untouched, do not."""
    if apg.kernels.native_library() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")

    def edit(root: Path) -> None:
        replace_in(root / "kernels" / "rings.c", "+ (T)1e-3;", "+ (T)2e-3;", count=2)

    before = fingerprints_of_copy(tmp_path / "a")
    # its own cache: the kernels' cache key hashes their source, but keep ~/.cache clean
    after = fingerprints_of_copy(tmp_path / "b", edit, env={"APG_KERNEL_CACHE": str(tmp_path / "kernels")})
    assert after["dgmm/apg"] != before["dgmm/apg"]
    assert after["gmm/apg"] == before["gmm/apg"] and after["gmm/rws-mlp"] == before["gmm/rws-mlp"]
