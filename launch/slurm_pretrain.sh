#!/usr/bin/env bash
# Multi-node pretraining under SLURM: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch --nodes 2 launch/slurm_pretrain.sh --preset 8b --cp-size 8 --seq-mode concat \
#       --seq-len 131072 --tokens-per-batch 131072 --out-dir /shared/runs/8b --resume --allow-fresh-start
#
# Arguments go to cp_rope.launch.pretrain. --out-dir must be on a filesystem every node sees
# (checkpoints are written by all ranks). With --resume, resubmitting the same job continues
# from the newest complete checkpoint (--allow-fresh-start: the first submission, with no
# checkpoint yet, starts the run; without it --resume needs a checkpoint); SLURM's --signal
# below sends SIGTERM 120 s before the time limit, and the trainer saves a checkpoint when it gets it (--save-on-signal, default on).
#
#SBATCH --job-name=cp-rope-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --signal=TERM@120
#SBATCH --output=%x-%j.out
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_addr=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# NCCL: uncomment what your fabric needs, e.g. export NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5
args=$(printf ' %q' "$@")  # keep each argument whole through bash -c
echo "nodes: $SLURM_JOB_NUM_NODES x $GPUS_PER_NODE GPUs, rendezvous $head_addr:29500"
# `exec` inside srun so that SLURM's SIGTERM reaches torchrun, which forwards it to the trainers.
srun --kill-on-bad-exit=1 bash -c "exec torchrun \
  --nnodes $SLURM_JOB_NUM_NODES --nproc-per-node $GPUS_PER_NODE \
  --rdzv-backend c10d --rdzv-endpoint $head_addr:29500 --rdzv-id $SLURM_JOB_ID \
  -m cp_rope.launch.pretrain$args"
