#!/usr/bin/env bash
# Run the unchanged SMP v1 example script through `smp2ds launch` with the deepspeed launcher:
# 2 ranks (CPU/gloo without GPUs), micro-batches 2, optimizer-state sharding (ZeRO-1).
# Prints the plan, the loss per step and a digest of the final weights; writes a partial SMP
# checkpoint under $OUT (default: a temp dir).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$(mktemp -d -t smp2ds-demo-XXXXXX)}"
export OMP_NUM_THREADS=1
echo "SMP parameters ($HERE/demo_smp_parameters.json):"
cat "$HERE/demo_smp_parameters.json"
# The launcher and DeepSpeed log at INFO level; show only the script's own output.
smp2ds launch --config "$HERE/demo_smp_parameters.json" --nproc-per-node 2 --launcher deepspeed \
  -- "$HERE/train_smp_mlp.py" --steps 8 --checkpoint-dir "$OUT/checkpoints" 2>&1 \
  | grep -v -E '^\[20[0-9-]+ .*(INFO|WARNING)\]|FutureWarning|return func\(|shm_comm_op'
echo "partial checkpoint written to $OUT/checkpoints: $(ls "$OUT/checkpoints" | tr '\n' ' ')"
