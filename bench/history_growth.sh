#!/usr/bin/env bash
# Bytes that the commits in FROM..TO add to a clone's history: the objects TO reaches and FROM
# does not, each as git stores it in this repository's packs and loose objects (zlib, deltas
# where git packed them; run `git gc` first for the sizes a fresh clone would see).
#   bash bench/history_growth.sh 10828f4 HEAD      # one submission's growth
# The bound kept (docs/recorded.md): 25 MB a landed submission on average.
set -euo pipefail
from=${1:?FROM commit}; to=${2:-HEAD}
git rev-list --objects "$from..$to" | cut -d' ' -f1 |
  git cat-file --batch-check='%(objecttype) %(objectsize:disk) %(objectsize)' |
  awk '{disk += $2; raw += $3; n[$1]++} END {
    printf "%d objects (%d blobs): %.1f MB stored, %.1f MB uncompressed\n", NR, n["blob"], disk / 1e6, raw / 1e6 }'
