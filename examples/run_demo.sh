#!/usr/bin/env bash
# Run the unchanged SMP v1 example script on CPU with the deepspeed launcher: 2 ranks,
# micro-batches 2, optimizer-state sharding (ZeRO-1). Prints the plan, the loss per step and
# a digest of the final weights; writes a partial SMP checkpoint under $OUT (default: a temp dir).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$(mktemp -d -t smp2ds-demo-XXXXXX)}"
PORT="${PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
export SM_HP_MP_PARAMETERS='{"ddp": true, "microbatches": 2, "shard_optimizer_state": true, "partitions": 1}'
echo "SM_HP_MP_PARAMETERS=$SM_HP_MP_PARAMETERS"
# The launcher and DeepSpeed log at INFO level; show only the script's own output.
deepspeed --num_gpus 2 --master_port "$PORT" "$HERE/train_smp_mlp.py" --steps 8 --checkpoint-dir "$OUT/checkpoints" 2>&1 \
  | grep -v -E '^\[20[0-9-]+ .*(INFO|WARNING)\]|FutureWarning|return func\(|shm_comm_op'
echo "partial checkpoint written to $OUT/checkpoints: $(ls "$OUT/checkpoints" | tr '\n' ' ')"
