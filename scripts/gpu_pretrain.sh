#!/usr/bin/env bash
# GPU pretraining benchmark + parity check (2 GPUs, NCCL, bf16 via FSDP2 mixed precision).
# Run from the repository root (installs cp-rope editable, without network, if it is not yet):
#
#   bash scripts/gpu_pretrain.sh            # ~4 minutes on 2 x H200
#
# (i)  1b preset (Llama-3.2-1B shapes, byte vocabulary) on the Python stdlib corpus in
#      --seq-mode concat (documents concatenated and cut into fixed-length sequences):
#        cp_size 2: one 131072-token sequence per step, split over the 2 GPUs (dp 1 x cp 2)
#        cp_size 1: one 65536-token sequence per GPU per step (dp 2 x cp 1), same 131072 tokens/step
#      Each prints per-log-step loss, LR, tokens/s, tokens/s per GPU, MFU, peak memory, and a
#      "done:" line with first -> last loss; metrics.jsonl in runs/gpu_cp{2,1}/.
#      If a run runs out of memory it is retried once with --activation-checkpointing.
# (ii) parity: one training step at cp 2 (and dp 2) vs a single-GPU run, FSDP2 bf16,
#      bf16 tolerances (tests/test_pretrain_parity.py under torchrun).
#
# Environment: STEPS (default 10), NPROC (default 2), PRESET (default 1b), SEQ (cp-2 sequence
# length, default 131072; cp 1 uses SEQ / 2), EXTRA (more flags).
# Dry run of the script's logic on a CPU machine: PRESET=tiny SEQ=2048 STEPS=3 bash scripts/gpu_pretrain.sh
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import cp_rope.parallel, cp_rope.launch" 2>/dev/null \
  || python -m pip install -q --no-deps --no-build-isolation -e . \
  || { echo "gpu_pretrain: cannot install cp-rope (pip install -e .)" >&2; exit 1; }
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
STEPS=${STEPS:-10}
NPROC=${NPROC:-2}
PRESET=${PRESET:-1b}
SEQ=${SEQ:-131072}
EXTRA=${EXTRA:-}
python -c "import torch; print('torch', torch.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"

run() {  # run <cp_size> <seq_len>
  local cp=$1 seq=$2 log="runs/gpu_cp$1.log"
  mkdir -p runs
  local args=(--preset "$PRESET" --cp-size "$cp" --seq-mode concat --seq-len "$seq"
              --tokens-per-batch "$seq" --steps "$STEPS" --warmup-steps 5 --log-every 5
              --no-progress --no-save-final --out-dir "runs/gpu_cp$cp" --overwrite $EXTRA)
  echo "=== cp_size $cp: $((seq * NPROC / cp)) tokens/step ($seq-token sequences), preset $PRESET ==="
  torchrun --standalone --nproc-per-node "$NPROC" -m cp_rope.launch.pretrain "${args[@]}" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ] && grep -qi "out of memory" "$log"; then
    echo "=== cp_size $cp: out of memory; retrying with --activation-checkpointing ==="
    torchrun --standalone --nproc-per-node "$NPROC" -m cp_rope.launch.pretrain "${args[@]}" \
      --activation-checkpointing 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
  fi
  echo "=== cp_size $cp: exit $rc ==="
  return "$rc"
}

status=0
run 2 "$SEQ" || status=1
run 1 $((SEQ / 2)) || status=1
echo "=== parity: one step, cp $NPROC and dp $NPROC vs single GPU (FSDP2 bf16) ==="
torchrun --standalone --nproc-per-node "$NPROC" tests/test_pretrain_parity.py || status=1
echo "=== summary ==="
grep -h "^done:\|^cp-rope pretrain:" runs/gpu_cp2.log runs/gpu_cp1.log
exit $status
