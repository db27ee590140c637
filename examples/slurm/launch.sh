#!/bin/bash
# Runs once per node (srun starts it on every node of the job), so that $SLURM_NODEID is
# expanded here, on each node. Expanded in the batch script instead, it would be node 0's
# value on every node: every node would claim rank 0 (see docs/slurm.md).
#
# MASTER_ADDR and RUN_NAME come from traceml_ddp.sbatch (the same on every node). MASTER_PORT,
# when set, replaces the rendezvous port 29500. SLURM_GPUS_ON_NODE is unset on nodes without
# GPUs: one worker there. Arguments are passed on to `traceml run`: more flags, and the
# training script's own arguments.
set -euo pipefail

exec traceml run examples/ddp_minimal.py \
  --mode=summary \
  --run-name="${RUN_NAME}" \
  --nnodes="${SLURM_NNODES}" \
  --node-rank="${SLURM_NODEID}" \
  --nproc-per-node="${SLURM_GPUS_ON_NODE:-1}" \
  --master-addr="${MASTER_ADDR}" \
  --master-port="${MASTER_PORT:-29500}" \
  "$@"
