#!/usr/bin/env bash
# A sitting of continuing runs (pipeline/runs/) on a GPU machine, in one call: each folder in
# RUNS (default the long Bouncing MNIST run) is continued from what git holds, compiled with
# CUDA graphs, in a copy under $OUT, for an equal share of MINUTES; if a compiled sitting
# fails, that run goes on eagerly for its share's minutes left.
#   APG_COMMIT=$(git rev-parse --short HEAD) MNIST_DIR=.device/mnist MINUTES=8 OUT=$OUT \
#     RUNS="recorded/bmnist-long recorded/bmnist-long-avf" bash bench/gpu_continue.sh
# What it leaves under $OUT is the sitting's log and the runs' tables and states tarred and
# split into parts under 15 MB (a GPU machine returns files of at most 16 MiB; the long
# run's state.pt is 20 MB). Then, here:
#   cat OUTDIR/runs.tar.* | tar x -C recorded/ && rm -f recorded/*/full-state.pt
# (a full state of an earlier step must not stand beside the newer compact one), rebuild the
# report (`apg-pipeline report --from-committed`) and commit both.
set -uo pipefail
OUT=${OUT:?set OUT}; MINUTES=${MINUTES:-8}; DEVICE=${DEVICE:-cuda}; RUNS=${RUNS:-recorded/bmnist-long}
export APG_MNIST_DIR=${MNIST_DIR:-.device/mnist} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export APG_NATIVE_KERNELS=0   # the C kernels are for CPU tensors: nothing to build on a GPU machine
start=$(date +%s)
read -r -a runs <<< "$RUNS"
exec > >(tee -a "$OUT/continue.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
mkdir -p "$OUT/runs"
for i in "${!runs[@]}"; do
  src=${runs[$i]}; run=$OUT/runs/$(basename "$src")
  # this run's share: the minutes left over the runs left
  share=$(python3 -c "print(max(0.0, ($MINUTES - ($(date +%s) - $start) / 60) / (${#runs[@]} - $i)))")
  until=$(python3 -c "print($(date +%s) + 60 * $share)")
  left() { python3 -c "print(max(0.0, ($until - $(date +%s)) / 60))"; }
  mkdir -p "$run"
  cp "$src"/{run.json,history.csv,evals.csv,segments.csv} "$run"/ 2>/dev/null
  cp "$src"/state.pt "$run"/ 2>/dev/null  # what git holds (none before a run's first checkpoint)
  sitting() { python3 -m pipeline.cli continue "$run" --minutes "$(left)" --device "$DEVICE" --no-full-state "$@"; }
  echo "== $src: $share minutes from $(date +%T)"
  if [ "$DEVICE" = cuda ]; then
    sitting --compile || { echo "== the compiled sitting failed (exit $?): going on eagerly $(date +%T)"; sitting; }
  else
    sitting
  fi
  echo "exit $? at $(date +%T)"
done
tar cf "$OUT/runs.tar" -C "$OUT/runs" . && rm -rf "$OUT/runs"
(cd "$OUT" && split -b 15m -d runs.tar runs.tar. && rm runs.tar)
ls -la "$OUT"
