#!/usr/bin/env bash
# H200 benchmark of issue 34 (and the finetune_hf backend line of issue 31): TRL's SFTTrainer with
# cp_rope.hf.prepare (scripts/sft_trl_example.py) next to cp_rope's own finetune_hf, on the same
# Qwen3-shaped model and the same data, 32,768 tokens per step, one GPU (cp 1: the whole row on the
# GPU; the step is the same kernels a cp group's rank runs, without the exchange).
#
#   bash scripts/bench_hf_trl.sh          # repository root, through the device tool; table at the end
#
# Model: Qwen3-0.6B's shapes (hidden 1024, 28 layers, 16 query / 8 KV heads, head_dim 128, MLP
# 3072, vocabulary 151,936, tied embeddings), random weights written here with transformers (no
# download), a word-level tokenizer over the vocabulary (<pad>, </s>, <unk>, then "w3" .. "w151935": one
# word, one token).
# Data: 64 documents of 2,048-30,720 random words (seq / 16 .. 15 seq / 16) (one JSONL file), packed into 32,768-token rows
# by each trainer (TRL: packing=True, best-fit; finetune_hf: its own packer), bf16 autocast on fp32
# master weights in both, gradient checkpointing off, 12 optimizer steps, throughput over steps 3-12.
# Runs: trl (SFTTrainer + prepare, backend auto), finetune_hf --attn-backend auto / cudnn / fa4
# (fa4 only where flash-attn-4 is importable). Needs trl, datasets (+ dill, multiprocess) on the
# path: carried as wheels in $WHL (default .whl) and installed --no-deps into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
WORK=${WORK:-/tmp/cp_rope_bench_trl}
OUT=${OUT:-$WORK/out}
WHL=${WHL:-.whl}
STEPS=${STEPS:-12}
SEQ=${SEQ:-32768}
LAYERS=${LAYERS:-28}  # a CPU dry run of the plumbing: LAYERS=1 SEQ=1024 STEPS=4
# CKPT=1: both with activation checkpointing (TRL --gradient-checkpointing, transformers' per-layer
# checkpoints; finetune_hf --activation-checkpointing full): without it TRL's 28 layers at 32,768
# tokens run out of 80 GB (bf16 autocast on fp32 weights keeps fp32 residuals and norms).
# FT_BACKENDS: finetune_hf's attention backends (default auto cudnn, and fa4 where installed).
PY=${PYTHON:-python3}
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
if compgen -G "$WHL/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl 2>&1 \
    | grep -v "^WARNING" || true
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d /tmp/site-fa4 ] && export PYTHONPATH=/tmp/site-fa4:/tmp/site-fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
$PY -c "import cp_rope.hf" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null

$PY - "$WORK" "$LAYERS" "$SEQ" <<'EOF' || { echo "bench_hf_trl: could not write the model and data" >&2; exit 1; }
import json, random, sys
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
work = sys.argv[1]
V = 151936
cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=1024, intermediate_size=3072,
                               num_hidden_layers=int(sys.argv[2]), num_attention_heads=16, num_key_value_heads=8,
                               head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                               tie_word_embeddings=True, torch_dtype="float32")
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(cfg).save_pretrained(f"{work}/model")
vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, V)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                     unk_token="<unk>").save_pretrained(f"{work}/model")
rng, seq = random.Random(0), int(sys.argv[3])
with open(f"{work}/docs.jsonl", "w") as f:
    for _ in range(64):
        n = rng.randint(seq // 16, seq * 15 // 16)
        f.write(json.dumps({"text": " ".join(f"w{rng.randrange(3, V)}" for _ in range(n))}) + "\n")
print("bench_hf_trl: model and data written")
EOF

results=()
run_trl() {
  timeout 420 $PY scripts/sft_trl_example.py --model-dir "$WORK/model" --data "$WORK/docs.jsonl" \
    --cp-size 1 --seq-len "$SEQ" --steps "$STEPS" --timing-warmup 2 --out-dir "$WORK/trl" \
    ${CKPT:+--gradient-checkpointing} \
    > "$OUT/trl.log" 2>&1
  local rc=$?
  local line; line=$(grep '^{' "$OUT/trl.log" | tail -1)
  results+=("trl_sft+prepare|$rc|$($PY -c "import json,sys; d=json.loads(sys.argv[1] or '{}'); print(f\"{d.get('tokens_per_s', float('nan')):.0f}|{d.get('peak_mem_gib', float('nan')):.2f}\")" "$line" 2>/dev/null || echo "nan|nan")")
}
run_ft() {  # run_ft BACKEND
  timeout 420 torchrun --standalone --nproc-per-node 1 -m cp_rope.launch.finetune_hf \
    --model "$WORK/model" --data "$WORK/docs.jsonl" --cp-size 1 --seq-len "$SEQ" \
    --tokens-per-batch "$SEQ" --steps "$STEPS" --warmup-steps 2 --eval-docs 0 --log-every 1 \
    --no-progress --no-tensorboard --attn-backend "$1" --out-dir "$WORK/ft_$1" --overwrite \
    --no-save-final --no-save-on-signal ${CKPT:+--activation-checkpointing full} \
    > "$OUT/ft_$1.log" 2>&1
  local rc=$?
  results+=("finetune_hf $1|$rc|$($PY - "$WORK/ft_$1/metrics.jsonl" <<'EOF' 2>/dev/null || echo "nan|nan"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "tokens_per_s" in r and r.get("step", 0) > 2]
tps = statistics.median(r["tokens_per_s"] for r in rows)
mem = max(r.get("peak_mem_gib", r.get("mem_gib", float("nan"))) for r in rows)
print(f"{tps:.0f}|{mem:.2f}")
EOF
)")
}
run_trl
for b in ${FT_BACKENDS:-auto cudnn}; do run_ft $b; done
[ -n "${FT_BACKENDS:-}" ] || { $PY -c "from cp_rope.parallel._compat import fa4_unavailable as u
raise SystemExit(u() is not None)" && run_ft fa4; }
echo "=== bench_hf_trl: Qwen3-0.6B shapes, $SEQ tokens per step, $STEPS steps, one GPU ==="
$PY -c "import torch, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
$PY -c "import trl; print('trl', trl.__version__)" 2>&1 | tail -1
echo "| run | rc | tokens/s (median, steps 3-$STEPS) | peak GiB |"
echo "| --- | --- | --- | --- |"
for r in "${results[@]}"; do echo "| ${r//|/ | } |"; done
