#!/usr/bin/env bash
# A sitting of the long Bouncing MNIST run (pipeline/runs/) on a GPU machine, in one call.
# It continues what git holds (recorded/bmnist-long/state.pt), compiled with CUDA graphs, in a
# copy under $OUT; if the compiled sitting fails, it goes on eagerly for the minutes left.
#   APG_COMMIT=$(git rev-parse --short HEAD) MNIST_DIR=.device/mnist MINUTES=8 OUT=$OUT \
#     bash bench/gpu_long_run.sh
# What it leaves under $OUT is the sitting's log and the run's tables and state tarred and
# split into parts under 15 MB (the device tool returns files of at most 16 MiB; state.pt is
# 20 MB). Then, here:
#   cat OUTDIR/bmnist-long.tar.* | tar x -C recorded/ && rm -f recorded/bmnist-long/full-state.pt
# (a full state of an earlier step must not stand beside the newer compact one), rebuild the
# report (`apg-pipeline report --from-committed`) and commit both.
set -uo pipefail
OUT=${OUT:?set OUT}; MINUTES=${MINUTES:-8}; DEVICE=${DEVICE:-cuda}
export APG_MNIST_DIR=${MNIST_DIR:-.device/mnist} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export APG_NATIVE_KERNELS=0   # the C kernels are for CPU tensors: nothing to build on a GPU machine
start=$(date +%s)
minutes_left() { python3 -c "print(max(0.0, $MINUTES - ($(date +%s) - $start) / 60))"; }
exec > >(tee -a "$OUT/long-run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
run=$OUT/bmnist-long
mkdir -p "$run"
cp recorded/bmnist-long/{run.json,state.pt,history.csv,evals.csv,segments.csv} "$run"/  # what git holds
sitting() { python3 -m pipeline.cli long-run --dir "$run" --minutes "$(minutes_left)" --device "$DEVICE" --no-full-state "$@"; }
if [ "$DEVICE" = cuda ]; then
  sitting --compile || { echo "== the compiled sitting failed (exit $?): going on eagerly $(date +%T)"; sitting; }
else
  sitting
fi
echo "exit $? at $(date +%T)"
tar cf "$OUT/bmnist-long.tar" -C "$OUT" bmnist-long && rm -rf "$run"
(cd "$OUT" && split -b 15m -d bmnist-long.tar bmnist-long.tar. && rm bmnist-long.tar)
ls -la "$OUT"
