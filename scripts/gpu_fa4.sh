#!/usr/bin/env bash
# FlashAttention-4 measurements of issue 31 on one GPU (an H200), in parts that fit one device
# call each; everything lands in $OUT (summary.txt, cal_<gpu>.json, logs.tgz):
#
#   bash scripts/gpu_fa4.sh tests calib bench     # GPU tests, calibration, attention benchmark
#   bash scripts/gpu_fa4.sh mfu smoke             # 1b preset MFU cudnn vs fa4, gpu_smoke.sh
#
#   tests  tests/test_fa4_gpu.py (-s: JIT compile time per variant) and the CPU glue tests
#   calib  python -m cp_rope.parallel.calibrate: cudnn and fa4 tables, the crossover per head_dim
#   bench  scripts/bench_cp_attention.py at head_dim 64 and 128, backends cudnn / fa4 / auto
#   mfu    --preset 1b, 65,536 tokens, cp 1 (bench_memory.py's 1b 65,536 flags), 8 steps each
#          with --attn-backend cudnn, fa4, auto: MFU of steps 4-8, losses side by side
#   smoke  bash scripts/gpu_smoke.sh (with its fa4 part)
#   window scripts/bench_window.py --simulate-cp 4 --no-full (issue 32: windows, sinks, halo)
#   hf     scripts/bench_memory.py --only hf at 32,768 and 262,144 tokens (issue 31's finetune_hf
#          targets; the attention backend auto, so cuDNN + FA4 where FA4 is installed);
#          HF_TOP=2: those two configs alone (bench_memory --top 2), not the 262K comparisons
#   profile  scripts/profile_trainer.py at 32,768 (and its trace), the profile262 part, and the
#          model's step alone (scripts/profile_hf_step.py) at 32,768
#   profile262  scripts/profile_trainer.py at 262,144 tokens (bench_memory's selective + offload +
#          tiled config), 2 steps recorded, the op table by GPU time; PROFILE_LAUNCHERS=REGEX adds
#          the ops (shapes, code) that launched the kernels matching it
#   ab     bench_memory's 262,144-token target config again, once per flag set of $AB_FLAGS
#          (';'-separated, e.g. " ;--mlp-tile-tokens 32768;--no-fused-norm": ' ' is the config
#          as it is), bench_memory --flags each; environment settings such as
#          CP_ROPE_NORM_KERNEL=triton (cp_rope's RMSNorm, cp_rope/hf/norms.py) apply to every set
#   rmsnorm  scripts/bench_rms_norm.py: cp_rope's RMSNorm kernels vs Liger's and PyTorch's at the
#          262,144-token finetune_hf rows
#   trl    bash scripts/bench_hf_trl.sh (issue 34: SFTTrainer + prepare next to finetune_hf)
#   families  scripts/bench_families.py (issue 33: Gemma-3 and GPT-OSS shapes at 131,072)
#
# FA4 itself: ../shared/tools/fa4_carry.sh's two install steps. Step 1 (unpack .fa4a into
# /tmp/site-fa4) runs in the device call before; this script does step 2 from $FA4B (default
# .fa4b) when that folder exists. Other wheels (tyro, cudnn frontend, liger) from $WHL (.whl).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
OUT=${OUT:-/tmp/cp_rope_fa4}
LOGS=${LOGS:-/tmp/cp_rope_fa4_logs}  # under $OUT: the logs come back even from a cut-off call
WHL=${WHL:-.whl}
FA4B=${FA4B:-.fa4b}
PY=python3
mkdir -p "$OUT" "$LOGS"
SUMMARY=$OUT/summary.txt
say() { echo "$*" | tee -a "$SUMMARY"; }

if compgen -G "$WHL/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl 2>&1 | grep -v "^WARNING" || true
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -d "$FA4B" ] && [ -d /tmp/site-fa4 ]; then
  for w in "$FA4B"/*.whl; do $PY -m zipfile -e "$w" /tmp/site-fa4; done
fi
[ -d /tmp/site-fa4 ] && export PYTHONPATH=/tmp/site-fa4:/tmp/site-fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || { say "gpu_fa4: cannot install cp-rope (pip install -e .)"; exit 1; }
$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch
from cp_rope.parallel._compat import cudnn_frontend_unavailable, fa4_unavailable, fa4_version
p = torch.cuda.get_device_properties(0)
print(f"hardware: {p.name}, sm{p.major}{p.minor}; torch {torch.__version__}, CUDA "
      f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; flash-attn-4 "
      f"{fa4_version()}: {fa4_unavailable() or 'ok'}; cudnn-frontend: "
      f"{cudnn_frontend_unavailable() or 'ok'}")
try:
    import importlib.metadata as md
    print("nvidia-cutlass-dsl", md.version("nvidia-cutlass-dsl"), "cudnn-frontend",
          md.version("nvidia-cudnn-frontend"))
except Exception as exc:  # noqa: BLE001
    print("versions:", exc)
EOF
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")

part_tests() {
  timeout 300 $PY -m pytest -q -s -p no:cacheprovider -m gpu tests/test_fa4_gpu.py \
    > "$LOGS/tests.log" 2>&1
  local rc=$?
  grep -E "^FA4 variant|passed|failed|Error" "$LOGS/tests.log" | tail -12 | tee -a "$SUMMARY"
  return $rc
}

part_calib() {
  local t=$(date +%s)
  timeout 300 $PY -m cp_rope.parallel.calibrate --out "$OUT/cal_$GPU.json" > "$LOGS/calib.log" 2>&1
  local rc=$?
  tail -2 "$LOGS/calib.log" | tee -a "$SUMMARY"
  say "calibrate: $(( $(date +%s) - t )) s"
  return $rc
}

part_bench() {
  local rc=0
  for d in 64 128; do
    timeout 280 $PY scripts/bench_cp_attention.py --head-dim "$d" --backends cudnn fa4 auto \
      --layouts ${BENCH_LAYOUTS:-1x65536 1x131072 random 32768+64x1536 64x2048 512x256} \
      --iters "${BENCH_ITERS:-5}" --warmup 2 \
      --out "$LOGS/bench$d" > "$LOGS/bench$d.log" 2>&1 || rc=1
    $PY - "$LOGS/bench$d/cp_attention_cp1.md" "$d" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import sys
rows = {}
for line in open(sys.argv[1]):
    c = [x.strip() for x in line.split("|")[1:-1]]
    if len(c) == 11 and c[2] == "cp_rope" and c[6] not in ("-", "fwd+bwd ms"):
        rows.setdefault(c[0], {})[c[3].split(" ")[0]] = (float(c[6]), c[3])
print(f"head_dim {sys.argv[2]}: layout | cudnn ms | fa4 ms | auto ms | auto / faster | cudnn / auto")
for lay, r in rows.items():
    c, f, a = (r.get(k, (float("nan"), ""))[0] for k in ("cudnn", "fa4", "auto"))
    print(f"{lay} | {c:.2f} | {f:.2f} | {a:.2f} ({r.get('auto', (0, '?'))[1]}) | "
          f"{a / min(c, f):.3f} | {c / a:.3f}")
EOF
  done
  return $rc
}

part_mfu() {
  local rc=0
  for be in cudnn fa4 auto; do
    local t=$(date +%s) dir=/tmp/cp_rope_mfu_$be
    timeout 170 torchrun --standalone --nproc-per-node 1 -m cp_rope.launch.pretrain --preset 1b \
      --seq-mode concat --seq-len 65536 --tokens-per-batch 65536 --steps 100 --stop-at-step 8 \
      --log-every 1 --no-save-final --no-save-on-signal --no-progress --no-tensorboard \
      --warmup-steps 10 --tokenizer bytes --eval-docs 0 --attn-backend "$be" --overwrite \
      --out-dir "$dir" > "$LOGS/mfu_$be.log" 2>&1 || rc=1
    $PY - "$dir/metrics.jsonl" "$be" "$(( $(date +%s) - t ))" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
steps = [r for r in rows if "tokens_per_s" in r]
late = [r for r in steps if r["step"] >= 4]
mfu = sum(r.get("mfu", 0) for r in late) / max(len(late), 1)
tps = sum(r["tokens_per_s"] for r in late) / max(len(late), 1)
first = next((r for r in rows if r.get("step") == 1 and "step_time_s" in r), {})
print(f"1b 65536 --attn-backend {sys.argv[2]}: MFU steps 4-8 {100 * mfu:.1f}%, "
      f"{tps:,.0f} tokens/s; wall {sys.argv[3]} s; losses " +
      " ".join(f"{r['loss']:.4f}" for r in steps if "loss" in r))
print(f"  keys of a step record: {sorted(late[-1]) if late else rows[-1:]}")
EOF
  done
  return $rc
}

part_smoke() {
  RUNS=/tmp/cp_rope_smoke OUT=$LOGS/smoke timeout 420 bash scripts/gpu_smoke.sh \
    > "$LOGS/smoke.log" 2>&1
  local rc=$?
  sed -n '/=== gpu_smoke summary/,$p' "$LOGS/smoke.log" | tee -a "$SUMMARY"
  return $rc
}

part_window() {
  timeout 300 $PY scripts/bench_window.py --iters 5 --warmup 2 --simulate-cp 4 --no-full \
    --out "$LOGS/window" > "$LOGS/window.log" 2>&1
  local rc=$?
  grep -E "^\|" "$LOGS/window.log" | tee -a "$SUMMARY"
  return $rc
}

part_hf() {
  timeout 420 $PY scripts/bench_memory.py --only hf --tokens "${HF_TOKENS:-32768,262144}" \
    ${HF_TOP:+--top "$HF_TOP"} --budget-s 380 --out "$LOGS/hf.json" > "$LOGS/hf.log" 2>&1
  local rc=$?
  grep -E "^\|" "$LOGS/hf.log" | tee -a "$SUMMARY"
  return $rc
}

part_profile() {
  local rc=0
  timeout 150 $PY scripts/profile_trainer.py --tokens 32768 --table 45 --trace "$OUT/trace_32k.json.gz" \
    > "$LOGS/profile_32k.log" 2>&1 || rc=1
  grep -E '^\{"tokens"' "$LOGS/profile_32k.log" | tee -a "$SUMMARY"
  part_profile262 || rc=1  # 262,144 tokens, its op table by GPU time
  timeout 100 $PY scripts/profile_hf_step.py --tokens 32768 --steps 4 2>"$LOGS/hf_step.log" \
    | tee -a "$SUMMARY" || rc=1
  return $rc
}

part_profile262() {
  timeout 200 $PY scripts/profile_trainer.py --tokens 262144 --steps 5 --first 3 --record 2 \
    --table 40 --sort device ${PROFILE_LAUNCHERS:+--launchers "$PROFILE_LAUNCHERS"} \
    --flags "--activation-checkpointing selective --offload-activations --mlp-tile-tokens 16384" \
    > "$LOGS/profile_262k.log" 2>&1
  local rc=$?
  grep -E '^\{"tokens"' "$LOGS/profile_262k.log" | tee -a "$SUMMARY"
  return $rc
}

part_ab() {
  local rc=0 i=0 flags
  if [ -z "${AB_FLAGS:-}" ]; then
    say "ab: AB_FLAGS is empty: give one or more ';'-separated flag sets (' ' for the config as is)"
    return 1
  fi
  IFS=';' read -ra sets <<< "$AB_FLAGS"
  for flags in "${sets[@]}"; do
    i=$((i + 1))
    timeout 200 $PY scripts/bench_memory.py --only hf --tokens 262144 --top 1 --budget-s 170 \
      --flags="$flags" --out "$LOGS/ab$i.json" > "$LOGS/ab$i.log" 2>&1 || rc=1
    grep -E "^\| hf" "$LOGS/ab$i.log" | tee -a "$SUMMARY"
  done
  return $rc
}

part_rmsnorm() {
  timeout 200 $PY scripts/bench_rms_norm.py > "$LOGS/rmsnorm.log" 2>&1
  local rc=$?
  grep -E "^\||^RMSNorm" "$LOGS/rmsnorm.log" | tee -a "$SUMMARY"
  [ $rc = 0 ] || tail -5 "$LOGS/rmsnorm.log" | tee -a "$SUMMARY"
  return $rc
}

part_trl() {
  WORK=/tmp/cp_rope_bench_trl OUT=$LOGS/trl timeout 500 bash scripts/bench_hf_trl.sh \
    > "$LOGS/trl.log" 2>&1
  local rc=$?
  tail -12 "$LOGS/trl.log" | tee -a "$SUMMARY"
  return $rc
}

part_families() {
  timeout 540 $PY scripts/bench_families.py --out "$LOGS/families" ${FAMILIES_ARGS:-} \
    > "$LOGS/families.log" 2>&1
  local rc=$?
  tail -16 "$LOGS/families.log" | tee -a "$SUMMARY"
  return $rc
}

status=0
for part in "$@"; do
  t=$(date +%s)
  "part_$part"
  rc=$?
  [ $rc = 0 ] || status=1
  say "== part $part: rc $rc ($(( $(date +%s) - t )) s)"
done
case $LOGS in "$OUT"/*) ;; *) tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null ;; esac
exit $status
