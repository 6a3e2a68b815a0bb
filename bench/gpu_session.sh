#!/usr/bin/env bash
# One GPU machine's run in one call (it has PyTorch, not Ray, MLflow or DVC):
#   1. every paper cell's training step on the GPU (bench/paper_scale.py --device cuda; with
#      COMPILE=1 also compiled, --compile, within COMPILE_S seconds: COMPILE_TASKS x
#      COMPILE_METHODS x COMPILE_PAIRS, compiling beside the eager work, timed after it;
#      TIME_AFTER_TRAIN=1: timed after training, TIMING_S seconds kept for them, so that the
#      compilation overlaps the training instead of waiting for it),
#      the GPU's sampler against the CPU's on trained cells (bench/cuda_agreement.py: cells and
#      held-out sets carried in AGREE/<task>/{model.pt,test.npz,pair}), and with SHARE=1 four
#      trials sharing the GPU against one (bench/gpu_share.py: SHARE_TASK, SHARE_METHOD, SHARE_PAIR);
#      with TRAIN=0 that is all;
#   2. with CHECK=1, the gpu-bmnist profile under paper-check's caps: fails fast on a code path
#      the GPU breaks (training and evaluation, a few steps);
#   3. PROFILE (gpu-bmnist, or gpu-bmnist-3d: its second step, which needs gpu-bmnist's cells in
#      runs/gpu-bmnist/results) trained for MINUTES on the GPU (record --direct --stages train),
#      every cell stopped at the latest DEADLINE - 30 seconds after the start;
#   4. evaluated on the GPU if EVAL_MIN seconds are left, else later elsewhere:
#      apg-pipeline record $PROFILE --direct --stages evaluate --dir runs/$PROFILE
# Compiled training (train.compile on for every cell whose method compiles; Bouncing MNIST:
# per block, AVF eager) is the gpu-bmnist-compiled profile: PROFILE=gpu-bmnist-compiled.
# On a GPU every compiled graph has CUDA graphs, Bouncing MNIST's per-block ones included
# (4x faster on the H200; docs/benchmarks.md).
# What it makes goes under $OUT: the sandbox without its data, the recorded run if evaluated,
# tarred and split under 15 MB (the transfer's file limit), and the timings.
# Name the commit in APG_COMMIT: the GPU machine's copy may carry a stale git HEAD.
#   APG_COMMIT=$(git rev-parse --short HEAD) MNIST_DIR=.device/mnist AGREE=.device/agree MINUTES=6 \
#     DEADLINE=570 OUT=/tmp/out bash bench/gpu_session.sh
set -u
OUT=${OUT:?set OUT}; PROFILE=${PROFILE:-gpu-bmnist}; MINUTES=${MINUTES:-6}; DEADLINE=${DEADLINE:-570}; DEVICE=${DEVICE:-cuda}
EVAL_MIN=${EVAL_MIN:-150}; TIMINGS=${TIMINGS:-1}; COMPILE=${COMPILE:-0}; CHECK=${CHECK:-0}; AGREE=${AGREE:-.device/agree}
SHARE=${SHARE:-0}; TRAIN=${TRAIN:-1}; PARAMS=${PARAMS:-paper}  # the per-step sizes timed: a profile or a params file
export APG_MNIST_DIR=${MNIST_DIR:-.device/mnist} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export APG_NATIVE_KERNELS=0   # the C kernels are for CPU tensors: nothing to build on a GPU machine
start=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }
exec > >(tee -a "$OUT/session.log") 2>&1
pack() {
  tar czf "$OUT/gpu.tgz" --exclude="runs/$PROFILE/data" --exclude='*.pyc' "runs/$PROFILE" \
    $( [ -d "recorded/$PROFILE" ] && echo "recorded/$PROFILE" ) 2>/dev/null
  (cd "$OUT" && split -b 15m -d gpu.tgz gpu.tgz. && rm gpu.tgz)
  ls -la "$OUT"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

if [ "$COMPILE" = 1 ]; then  # compiled (train.compile: fullgraph, CUDA graphs), beside the eager work:
  # compilation is host work; the compiled cells are timed only once the GPU is free: after the
  # eager timings (with TIME_AFTER_TRAIN=1, after training)
  echo "== 1b. compiled per-step times at paper sizes, started $(date +%T)"
  rm -f "$OUT"/.eager_done; compiled_pids=()
  ( TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-8} timeout "${COMPILE_S:-300}" \
      python3 bench/paper_scale.py --params "$PARAMS" --device "$DEVICE" --steps 5 --compile \
      --tasks ${COMPILE_TASKS:-gmm dgmm} --methods ${COMPILE_METHODS:-apg rws-mlp} --pairs ${COMPILE_PAIRS:-10x10} \
      --wait-for "$OUT/.eager_done" --json "$OUT/paper_scale_cuda_compiled.json" \
      --markdown "$OUT/paper_scale_cuda_compiled.md" > "$OUT/compiled.log" 2>&1 ) &
  compiled_pids+=($!)
fi
if [ "$TIMINGS" = 1 ]; then
  echo "== 1. per-step times at paper sizes $(date +%T)"
  timeout 150 python3 bench/paper_scale.py --params "$PARAMS" --device "$DEVICE" --steps 5 \
    --json "$OUT/paper_scale_cuda.json" --markdown "$OUT/paper_scale_cuda.md" || echo "paper_scale: exit $?"
fi
for task in gmm dgmm bmnist; do  # AGREE/<task>/pair: the K and L to evaluate at (default 10 10)
  [ -f "$AGREE/$task/model.pt" ] || continue
  pair=$(cat "$AGREE/$task/pair" 2>/dev/null || echo "10 10")
  echo "== agreement $task $(date +%T)"
  timeout 60 python3 bench/cuda_agreement.py --cell "$AGREE/$task/model.pt" --data "$AGREE/$task/test.npz" \
    --pair $pair --seeds 4 --batch 20 --device "$DEVICE" --json "$OUT/agree_$task.json" || echo "agreement $task: exit $?"
done
if [ "$SHARE" = 1 ]; then  # trials sharing the GPU (gpus_per_trial 0.25): throughput of 4 against 1
  echo "== trials sharing the GPU $(date +%T)"
  timeout 120 python3 bench/gpu_share.py --params "$PARAMS" --device "$DEVICE" --task ${SHARE_TASK:-gmm} --method ${SHARE_METHOD:-apg} \
    --pair ${SHARE_PAIR:-10 10} --procs 1 4 --seconds 15 --json "$OUT/share.json" || echo "gpu_share: exit $?"
fi
finish_timings() {  # the compiled timings (if any) run now, then every timing is packed
  touch "$OUT/.eager_done"
  for pid in ${compiled_pids[@]+"${compiled_pids[@]}"}; do
    while kill -0 "$pid" 2>/dev/null && (( $(left) > ${PACK_S:-20} )); do sleep 2; done
    kill "$pid" 2>/dev/null && echo "compiled timings stopped at the deadline"
  done
  cat "$OUT"/compiled*.log 2>/dev/null
  mkdir -p "$OUT/t" && mv "$OUT"/agree_*.json "$OUT"/paper_scale_cuda* "$OUT"/share.json "$OUT"/compiled*.log "$OUT/t/" 2>/dev/null
  tar czf "$OUT/timings.tgz" -C "$OUT" t && rm -r "$OUT/t"
  rm -f "$OUT"/.eager_done  # the tool brings back 8 files at most
}
[ "${TIME_AFTER_TRAIN:-0}" = 1 ] && [ "$TRAIN" = 1 ] || finish_timings
[ "$TRAIN" = 1 ] || { ls -la "$OUT"; exit 0; }

if [ "${COMPILE_TRAIN:-0}" = 1 ]; then
  echo "COMPILE_TRAIN is gone: run PROFILE=gpu-bmnist-compiled (profiles/gpu-bmnist-compiled.yaml)"; exit 2
fi

if [ "$CHECK" = 1 ]; then
  echo "== 2. $PROFILE check $(date +%T)"
  if ! timeout 150 python3 -m pipeline.cli record "$PROFILE" --direct --device "$DEVICE" --check; then
    echo "check failed: not training"; exit 1
  fi
fi

after=$([ "${TIME_AFTER_TRAIN:-0}" = 1 ] && echo "${TIMING_S:-90}" || echo 0)  # kept for the timings
# Training gets what is left but the data (~20 s), the timing of the cells (~20 s) and
# packing: MINUTES at most, so that the schedule is planned to end before the deadline.
# MINUTES=none: the profile's own iterations (a compiled profile would compile twice if timed).
if [ "$MINUTES" = none ]; then
  sized=()
  echo "== 3. $PROFILE, its own iterations $(date +%T), $(left) s left"
else
  minutes=$(python3 -c "print(round(max(0.5, min($MINUTES, ($(left) - 90 - $after) / 60 * 0.95)), 2))")
  sized=(--minutes "$minutes")
  echo "== 3. $PROFILE, $minutes min of training $(date +%T), $(left) s left"
fi
deadline=$(python3 -c "print(($(left) - 30 - $after) / 60)")
python3 -m pipeline.cli record "$PROFILE" --direct --device "$DEVICE" --stages train \
  "${sized[@]}" --deadline "$deadline" || { echo "training failed"; [ "$after" = 0 ] || finish_timings; pack; exit 1; }
[ "$after" = 0 ] || finish_timings

if (( $(left) > EVAL_MIN )); then
  echo "== 4. evaluate on $DEVICE $(date +%T), $(left) s left"
  python3 -m pipeline.cli record "$PROFILE" --direct --device "$DEVICE" --stages evaluate &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    if (( $(left) < 15 )); then echo "deadline: evaluation stopped"; kill $pid; rm -rf "recorded/$PROFILE"; break; fi
    sleep 2
  done
  wait $pid; echo "evaluate: exit $?"
fi
echo "== packing $(date +%T), $(left) s left"
pack
