#!/usr/bin/env bash
# Multi-GPU runs of issue 16 on one host (NCCL, one process per GPU, NVLink multicast off):
#   (1) scripts/bench_cp_attention.py at cp_size NPROC: every layout and method;
#   (2) GPU bf16 attention parity at cp NPROC (tests/test_attention_gpu.py under torchrun);
#   (3) 1b pretraining at cp NPROC on one SEQ-token sequence, and on packed documents with
#       per-document placement; tokens/s per GPU, MFU, peak memory, loss.
# Usage (repository root, cp-rope installed or installable offline):
#   NPROC=2 STEPS=20 OUT=bench_out bash scripts/gpu_multi.sh
# Each part has its own time limit (BENCH_S, PARITY_S, TRAIN_S seconds) so one slow part cannot
# starve the others; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
NPROC=${NPROC:-2}; STEPS=${STEPS:-20}; SEQ=${SEQ:-131072}; OUT=${OUT:-bench_out}
BENCH_S=${BENCH_S:-240}; PARITY_S=${PARITY_S:-90}; TRAIN_S=${TRAIN_S:-200}
mkdir -p "$OUT"
python -c "import cp_rope.parallel, cp_rope.launch" 2>/dev/null \
  || python -m pip install -q --no-deps --no-build-isolation -e . \
  || { echo "gpu_multi: cannot install cp-rope" >&2; exit 1; }
TR="torchrun --standalone --nproc-per-node $NPROC"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== (1) bench_cp_attention at cp $NPROC ==="
timeout "$BENCH_S" $TR scripts/bench_cp_attention.py --iters 4 --warmup 1 --out "$OUT" \
  2>&1 | tee "$OUT/bench.log" | grep -v "^W1"
echo "=== (3a) 1b pretraining, cp $NPROC, one $SEQ-token sequence, $STEPS steps ==="
timeout "$TRAIN_S" $TR -m cp_rope.launch.pretrain --preset 1b --cp-size "$NPROC" --seq-mode concat \
  --seq-len "$SEQ" --tokens-per-batch "$SEQ" --steps "$STEPS" --warmup-steps 5 --log-every 5 \
  --no-progress --no-save-final --out-dir "runs/multi_cp$NPROC" --overwrite 2>&1 | tee "$OUT/train_seq.log" \
  | grep -E "step|done|error|Error" | tail -12
PLACEMENT=${PLACEMENT:-per_document}
echo "=== (3b) 1b pretraining, cp $NPROC, packed stdlib documents, $PLACEMENT placement ==="
timeout "$TRAIN_S" $TR -m cp_rope.launch.pretrain --preset 1b --cp-size "$NPROC" --seq-mode docs \
  --seq-len 16384 --tokens-per-batch "$SEQ" --cp-placement "$PLACEMENT" --steps "$STEPS" \
  --warmup-steps 5 --log-every 5 --no-progress --no-save-final --out-dir "runs/multi_docs$NPROC" \
  --overwrite 2>&1 | tee "$OUT/train_docs.log" | grep -E "step|done|error|Error" | tail -12
echo "=== (2) GPU bf16 attention parity at cp $NPROC ==="
timeout "$PARITY_S" $TR tests/test_attention_gpu.py 2>&1 | tee "$OUT/parity.log" | tail -15
echo "=== exit ==="
