"""The command lines that README.md and docs/*.md give, and what the tests do with each.

A command line is, in README.md or a page of docs/:

- a line of a fenced block whose info string is ``bash``, ``sh``, ``shell`` or ``console``
  (a console line's ``$ `` prompt taken off);
- a line of a fenced block with no info string whose every non-blank line begins with a
  program of ``PROGRAMS``;
- an inline code span of the prose whose first word is a program of ``PROGRAMS``.

In a block, a line ending in a backslash goes on with the next, and a trailing ``# ...``
comment is dropped; blank lines, comment lines and the shell's own syntax (``for ...; do``,
``done``) are not commands. Leading ``NAME=value`` assignments stay in the line and are
passed over when its first word is looked at.

Each command line is in one of two tables. ``RUN``: run in a fresh clone of the committed
tree by tests/pipeline/test_clone.py, in the order given, as the doc writes it or, where the
doc writes a template (``<cell>``, a path to fill in), as the command the table maps it to.
``NOT_RUN``: not run, each with its reason. A command added to the docs is in neither, and
tests/test_docs.py fails until it is run or listed; an entry the docs no longer give fails
it too. The ```python block of docs/library.md is not a command line: tests/test_docs.py runs it.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import REPO

PROGRAMS = frozenset(
    {
        "apg-pipeline",
        "dvc",
        "python",
        "mlflow",
        "git",
        "ray",
        "pip",
        "bash",
        "export",
        "nice",
        "cd",
        "curl",
        ".ci/run",
    }
)
SHELL_BLOCKS = frozenset({"bash", "sh", "shell", "console"})
SHELL_SYNTAX = re.compile(r"^(for|while|if) .*; (do|then)$|^(done|fi|else)$")
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def first_program(line: str) -> str:
    words = [word for word in line.split() if not ASSIGNMENT.match(word)]
    return words[0] if words else ""


def block_lines(body: str, console: bool) -> list[str]:
    """A shell block's command lines: continuations joined, comments and syntax dropped."""
    lines, held = [], ""
    for raw in body.splitlines():
        line = raw.strip()
        if console:
            line = line.removeprefix("$ ")
        if line.endswith("\\"):
            held += line[:-1].rstrip() + " "
            continue
        line, held = re.sub(r"(^|\s+)#.*$", "", held + line).strip(), ""
        if line and not SHELL_SYNTAX.match(line):
            lines.append(line)
    return lines


def block_commands(text: str) -> list[str]:
    """The command lines of one page's fenced blocks, in the order it gives them."""
    found: list[str] = []
    for fence in FENCE.finditer(text):
        info, body = fence.group(1), fence.group(2)
        unmarked = not info and all(
            first_program(line) in PROGRAMS for line in body.splitlines() if line.strip()
        )
        if info in SHELL_BLOCKS or unmarked:
            found += block_lines(body, console=info == "console")
    return found


def inline_commands(text: str) -> list[str]:
    """The command lines of one page's inline code spans (a span may run over a line break)."""
    spans = (" ".join(span.split()) for span in INLINE.findall(FENCE.sub("", text)) if "\n\n" not in span)
    return [span for span in spans if first_program(span) in PROGRAMS]


def doc_commands() -> dict[str, list[str]]:
    """Each command line of README.md and docs/*.md, with the pages that give it."""
    where: dict[str, list[str]] = {}
    for page in doc_pages():
        text = page.read_text()
        for command in block_commands(text) + inline_commands(text):
            where.setdefault(command, []).append(str(page.relative_to(REPO)))
    return where


# Run in the clone, in this order, by tests/pipeline/test_clone.py. A value is the line that
# runs: the doc's own, or its template filled in with ``{clone}`` (the clone), ``{tmp}`` (a
# folder outside it) or ``{mnist}`` (the MNIST files' folder, tests/support.py). A value
# naming ``test_clone.py::...`` is run by that test of the same clone, which checks more.
RUN: dict[str, str] = {
    "apg-pipeline preview": "apg-pipeline preview",
    "apg-pipeline report --from-committed": (
        "test_clone.py::test_a_clone_rebuilds_the_committed_report_byte_for_byte"
    ),
    "apg-pipeline config --profile smoke": "apg-pipeline config --profile smoke",
    "apg-pipeline config --profile NAME": "apg-pipeline config --profile paper",
    "python -m pipeline.provenance check": "python -m pipeline.provenance check",
    "python -m pipeline.provenance mark": "python -m pipeline.provenance mark",
    "dvc status": "dvc status",
    "dvc metrics show": "dvc metrics show",
    "dvc metrics diff": "dvc metrics diff",
    "dvc metrics diff main": "dvc metrics diff main",
    "dvc metrics diff main --md": "dvc metrics diff main --md",
    "dvc params diff": "dvc params diff",
    "dvc exp show": "dvc exp show",
    "dvc exp show --md --drop '.*' --keep '^(Experiment|Created|claims\\.\\w+)$'": (
        "dvc exp show --md --drop '.*' --keep '^(Experiment|Created|claims\\.\\w+)$'"
    ),
    "dvc exp show --md --only-changed -n 5": "dvc exp show --md --only-changed -n 5",
    "git show ceef86c:reports/README.md": "git show ceef86c:reports/README.md",
    "git show 96e42ab^:bench/RESULTS.md": "git show 96e42ab^:bench/RESULTS.md",
    "git log -p bench/RESULTS.md": "git log -p bench/RESULTS.md",
    "git log -p": "git log -p",
    "git show <commit>:<path>": "git show ceef86c:params.yaml",
    # the doc's /tmp path, in the test's own folder
    "git show d50d964:recorded/bmnist-long/state.pt > /tmp/apg-750.pt": (
        "git show d50d964:recorded/bmnist-long/state.pt > {tmp}/apg-750.pt"
    ),
    "git show <commit>:recorded/bmnist-long/state.pt > FILE": (
        "git show d50d964:recorded/bmnist-long/state.pt > {tmp}/state.pt"
    ),
    "git checkout params.yaml": "git checkout params.yaml",
    "git clone <repo> apg && cd apg": "git clone -q {clone} {tmp}/apg && cd {tmp}/apg",
    # a local repository: a file:// URL for --depth, and an upload-pack that allows filters
    # (the doc's own advice for a local copy)
    "git clone --depth 1 <repo> apg": "git clone -q --depth 1 file://{clone} {tmp}/shallow",
    "git clone --filter=blob:none <repo> apg": (
        'git clone -q --filter=blob:none --upload-pack="git -c uploadpack.allowFilter=true upload-pack" '
        "file://{clone} {tmp}/partial"
    ),
    # from another folder: the path holds wherever a command runs
    "export APG_MNIST_DIR=/absolute/path/to/mnist": (
        "export APG_MNIST_DIR={mnist} && cd {tmp} && "
        'python -c "from apg.data.mnist import mnist_files; mnist_files(allow_download=False)"'
    ),
    "apg-pipeline generate --task gmm --out data/train.npz --num-datasets 1000 --seed 1 --num-points 60": (
        "apg-pipeline generate --task gmm --out data/train.npz --num-datasets 1000 --seed 1 --num-points 60"
    ),
    "apg-pipeline generate --task gmm --out data/test.npz --num-datasets 100 --seed 2 --num-points 60": (
        "apg-pipeline generate --task gmm --out data/test.npz --num-datasets 100 --seed 2 --num-points 60"
    ),
    "apg-pipeline train --task gmm --method apg -K 5 -L 10 --batch-size 20 --iterations 600 --lr 0.01 "
    "--seed 0 --data data/train.npz --out ckpt.pt": (
        "apg-pipeline train --task gmm --method apg -K 5 -L 10 --batch-size 20 --iterations 600 --lr 0.01 "
        "--seed 0 --data data/train.npz --out ckpt.pt"
    ),
    "apg-pipeline evaluate --checkpoint ckpt.pt --data data/test.npz -K 10 -L 10 --out metrics.json": (
        "apg-pipeline evaluate --checkpoint ckpt.pt --data data/test.npz -K 10 -L 10 --out metrics.json"
    ),
    # the cell the block above trained, its test set as the observations, a fifth of them hidden;
    # --fill and --network are Bouncing MNIST's
    "apg-pipeline impute --checkpoint results/sweeps/gmm/cells/<cell>/model.pt --data obs.npz --mask mask.npz "
    "--out imputed.npz --iterations 20 -K 5 -L 10 [--fill mean] [--network num_digits=2]": (
        "python -c \"import numpy as np; x = np.load('data/test.npz')['x']; "
        "np.savez('obs.npz', x=x); np.savez('mask.npz', mask=np.random.default_rng(0).random(x.shape) < 0.2)\" && "
        "apg-pipeline impute --checkpoint ckpt.pt --data obs.npz --mask mask.npz --out imputed.npz "
        "--iterations 20 -K 5 -L 10"
    ),
    "python -m pytest -q tests/<file> -k <name>": "python -m pytest -q tests/test_docs.py -k ci_runs",
    # last: on a CPU type whose simulators round otherwise than the committed run's, it
    # records other GMM data in dvc.lock (issue 71: generate is not yet the same on every CPU)
    "dvc repro generate@gmm": "dvc repro generate@gmm",
}

_NOT_RUN_BECAUSE: dict[str, tuple[str, ...]] = {
    "the whole default pipeline: about 4 hours on 2 cores (README); "
    "tests/pipeline/test_stages.py::test_dvc_repro_end_to_end runs it on tiny params": (
        'pip install torch==2.13.0 && pip install -e ".[pipeline]" && dvc repro',
        "dvc repro",
        "dvc exp run -S gmm.train.iterations=5000",
        "dvc exp run -S key=value",
    ),
    "the paper's scale: GPU-weeks (docs/reproduce.md#the-papers-scale)": (
        "apg-pipeline config --profile paper --out params.yaml && dvc repro",
    ),
    "the report stage reads results/eval/, which only a run of the pipeline or a pull writes; "
    "a clone's path is `apg-pipeline report --from-committed` (run)": (
        "dvc repro report",
        "apg-pipeline report",
    ),
    "installs into the environment, and the fast tier takes 5-16 minutes; .ci/run runs the line "
    "verbatim (tests/test_docs.py checks that it does)": (
        'pip install torch==2.13.0 && pip install -e ".[pipeline,dev]" && python -m pytest -q -m '
        '"not slow and not cluster"',
        'pip install -e ".[pipeline]"',
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
    ),
    "the whole CI: about 21 minutes, installs included (README)": (".ci/run",),
    "minutes on 2 cores; tests/pipeline/test_stages.py::"
    "test_smoke_profile_runs_every_stage_of_every_task_from_scratch runs the smoke profile": (
        "apg-pipeline smoke",
    ),
    "recomputes every stage's numerics fingerprints: 1-3 minutes, and rewrites reports/provenance.json "
    "and dvc.lock; tests/pipeline/test_provenance.py runs it on small stages": (
        "python -m pipeline.provenance refresh",
    ),
    "needs a Ray cluster, an MLflow server or a cloud account (docs/cluster.md); "
    "tests/pipeline/test_cluster.py runs the sweep, the fetch and the UI on a loopback cluster": (
        "ray up cluster/aws-gpu.yaml && ray attach cluster/aws-gpu.yaml",
        "ray up",
        "ray start --head --port=6379 --num-cpus=0 --dashboard-host=127.0.0.1",
        "ray start --address=<head private ip>:6379",
        "mlflow server --backend-store-uri postgresql://apg@<db host>/mlflow --artifacts-destination "
        "s3://<bucket>/mlartifacts --host <head private ip> --port 5000",
        "mlflow server",
        "cd /mnt/shared/apg",
        "curl http://<host>:5000/health",
        "export RAY_ADDRESS=<head private ip>:6379 MLFLOW_TRACKING_URI=http://<head private ip>:5000",
        "dvc repro generate@$task && apg-pipeline sweep --task $task --fetch",
        "apg-pipeline eval-sweep --task $task",
        "apg-pipeline sweep --task <task> --fetch",
        "APG_UI_SCREENSHOT=$PWD/docs/mlflow-runs.png python -m pytest -m cluster tests/pipeline/test_cluster.py "
        "-k mlflow_ui",
    ),
    "reads the MLflow store a sweep writes (in a clone it says so in one line); "
    "tests/pipeline/test_tracking_store.py and test_cluster.py run it on a store": (
        "apg-pipeline runs-url",
        "mlflow ui --backend-store-uri sqlite:///$PWD/mlflow.db",
    ),
    "needs a DVC remote that a team has set up; tests/pipeline/test_dvc_remote.py runs remote add, "
    "push, clone, pull and repro --allow-missing with a folder as the remote": (
        "dvc remote add -d storage s3://<bucket>/apg",
        "dvc remote add -d storage /mnt/shared/apg-dvc",
        'git commit .dvc/config -m "DVC remote"',
        "dvc push",
        "dvc pull",
        "dvc repro --allow-missing",
    ),
    "only for a shallow clone, from its remote": ("git fetch --unshallow",),
    "a hyperparameter search: tens of minutes to hours; tests/pipeline/test_tune.py runs searches "
    "on tiny params, and the try.yaml one as docs/tuning.md gives it": (
        "apg-pipeline tune --task gmm",
        "apg-pipeline tune --task <task>",
        "apg-pipeline tune --task gmm --tune-params tuning/try.yaml --out results/tune/try --report results/tune/try",
        "apg-pipeline tune --task dgmm --method rws-mlp",
        "apg-pipeline tune --task gmm --method rws-mlp|rws-lstm --metric ess",
    ),
    "a sitting of a continuing run or a recorded profile: minutes to hours, writing into recorded/ "
    "(the cuda ones need a GPU); tests/pipeline/test_runs.py, test_bmnist_runs.py and test_recorded.py "
    "run them on small runs": (
        "apg-pipeline continue",
        "apg-pipeline continue --start dgmm/apg/K10/L10/seed0 dgmm/rws-mlp/K10/L10/seed0 --every log=50 "
        "checkpoint=250 eval=500 --steps 1",
        "nice -n 19 apg-pipeline continue recorded/paper-dgmm-* --minutes 30 &",
        "apg-pipeline continue recorded/bmnist-long-avf --minutes 12 --device cuda --compile",
        "apg-pipeline continue --start bmnist/apg/K5/L10/seed0 --minutes 60",
        "apg-pipeline continue recorded/bmnist-long --minutes 60",
        "apg-pipeline continue recorded/bmnist-long --minutes 12 --device cuda --compile",
        "nice -n 19 apg-pipeline continue recorded/bmnist-long --minutes 600 &",
        "apg-pipeline continue --start bmnist/rws-mlp/K5/L10/seed0 --steps 500",
        "apg-pipeline continue recorded/bmnist-long-rws-mlp --minutes 60",
        "MINUTES=10 OUT=/tmp/out bash bench/gpu_continue.sh",
        "bash bench/gpu_session.sh",
        "apg-pipeline record <profile>",
        "apg-pipeline record replicate",
        "apg-pipeline record replicate --tasks gmm",
        "apg-pipeline record paper-check",
        "apg-pipeline record <profile> --direct --device cuda",
        "apg-pipeline record gpu-gmm --direct --device cuda",
        "apg-pipeline record gpu-bmnist --direct --device cuda --minutes 7",
    ),
    "scores a long run on the paper's T x D sets: minutes on 2 cores, rewriting the run's committed "
    "rows; tests/pipeline/test_bmnist_runs.py runs the grid on a small state": (
        "apg-pipeline grid",
        "apg-pipeline grid recorded/bmnist-long [--videos 20]",
        "apg-pipeline grid recorded/bmnist-long --state FILE",
        "apg-pipeline grid recorded/bmnist-long --sets T10_D3,T20_D4",
        "apg-pipeline grid recorded/bmnist-long-rws-mlp --videos 20",
        "apg-pipeline grid recorded/bmnist-long --videos 20 --state /tmp/apg-750.pt",
    ),
    "commits a sitting's runs": (
        'git add recorded/paper-dgmm-* && git commit -m "runs: ..."',
        'git add recorded/bmnist-long && git commit -m "runs: bmnist-long steps ..."',
    ),
    "a benchmark: it measures for minutes (the cuda ones on a GPU), and docs/benchmarks.md holds its "
    "numbers with their machine and date": (
        "python bench/fingerprint_stability.py --params params.yaml",
        "python bench/fingerprint_stability.py --params smoke",
        "python bench/bench_gmm.py --threads 2 --steps 30",
        "python bench/bench_dgmm.py --threads 2 --steps 10",
        "python bench/bench_bmnist.py",
        "python bench/seeds.py",
        "python bench/bench_bmnist.py --repeats 5 --skip-sweep",
        "python bench/bench_bmnist.py --skip-step --threads 1 --sweep-repeats 5",
        "python bench/ab_step.py --old de13b1b --task bmnist --threads 1 --steps 6 --warmup 2 "
        "--weights recorded/bmnist-long",
        "python bench/ab_step.py --old 495df79 --task bmnist --threads 1 --steps 8 --warmup 2 "
        "--weights recorded/bmnist-long",
        "python bench/ab_step.py --old 6899b1b --task bmnist --cell apg --threads 1 --steps 20",
        "python bench/ab_step.py --old 6899b1b --task bmnist --threads 1 --steps 6 --warmup 2 "
        "--weights recorded/bmnist-long",
        "python bench/ab_step.py --old 824dfb6",
        "python bench/ab_step.py --old <git rev> --task gmm|dgmm",
        "python bench/paper_scale.py",
        "python bench/paper_scale.py --device cuda --steps 5",
        "python bench/paper_scale.py --device cuda --steps 5 --compile",
        "python bench/data_scale.py --videos 60000 --readers rows",
        "python bench/stage_rates.py",
        "python bench/stage_rates.py --seconds 15",
        "python bench/stage_rates.py --seconds 15 --tasks bmnist",
        "python bench/paper_scale.py --device cuda --steps 5 --compile --tasks gmm dgmm --methods apg rws-mlp "
        "--pairs 10x10",
        "python bench/compiled_step.py --tasks gmm dgmm bmnist --methods apg rws-mlp --steps 10 --threads 1",
        "python bench/bmnist_diagnostics.py apg --init <its model.pt> --digits 3 --frames 10 --videos 5 "
        "--iterations 1 --every 1 --lr 1e-12 --sweeps 5 --particles 10 --heldout --eval-videos 100 "
        "--eval-frames 10 --eval-sweeps 20 --eval-particles 10",
        "python bench/bmnist_diagnostics.py apg --digits 3 --frames 10 --videos 5000 --batch 10 --sweeps 5 "
        "--particles 10 --heldout --eval-videos 100 ...",
        "python bench/gpu_share.py --procs 1 4 --seconds 15",
        "python bench/cuda_agreement.py",
        "python bench/plateau_power.py --task dgmm --rise 99",
        "nice -n 10 python bench/gmm_globals_init.py --starts conjugate",
        "nice -n 10 python bench/gmm_globals_init.py --starts default",
        "python bench/gmm_globals_init.py",
        "bash bench/history_growth.sh FROM TO",
    ),
}
NOT_RUN: dict[str, str] = {command: why for why, commands in _NOT_RUN_BECAUSE.items() for command in commands}
