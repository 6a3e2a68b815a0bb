#!/usr/bin/env bash
# A sitting of the long Bouncing MNIST run (pipeline/longrun.py) on a GPU machine, in one call.
# It continues what git holds (recorded/bmnist-long/state.pt), compiled with CUDA graphs, in a
# copy under $OUT, so that what comes back is the run's folder:
#   APG_COMMIT=$(git rev-parse --short HEAD) MNIST_DIR=.device/mnist MINUTES=10 OUT=$OUT \
#     bash bench/gpu_long_run.sh
# Then, here: copy state.pt, history.csv, evals.csv and segments.csv from the returned
# bmnist-long/ into recorded/bmnist-long/ (no full-state.pt is written there: the copy is
# discarded), run `dvc repro report` and commit both.
set -euo pipefail
OUT=${OUT:?set OUT}; MINUTES=${MINUTES:-10}; DEVICE=${DEVICE:-cuda}
export APG_MNIST_DIR=${MNIST_DIR:-.device/mnist} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export APG_NATIVE_KERNELS=0   # the C kernels are for CPU tensors: nothing to build on a GPU machine
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
cp -r recorded/bmnist-long "$OUT/bmnist-long"
rm -f "$OUT/bmnist-long/full-state.pt"  # only what git holds travels
python3 -m pipeline.cli long-run --dir "$OUT/bmnist-long" --minutes "$MINUTES" --device "$DEVICE" --no-full-state \
  $( [ "$DEVICE" = cuda ] && echo --compile ) 2>&1 | tee "$OUT/long-run.log"
ls -la "$OUT/bmnist-long"
