#!/bin/bash
# Two (or more) machines without a scheduler: run this same command on every node.
#
#   HEAD=node0.example.org NNODES=2 GPUS_PER_NODE=8 examples/torchrun_two_nodes.sh --mock-data
#
# Arguments go to pretrain_gpt.py. The node named by HEAD hosts the c10d rendezvous (it must be
# reachable from the others on PORT); torchrun assigns node ranks itself, so no node needs to
# be told which one it is. See docs/multinode.md.
set -euo pipefail

: "${HEAD:?set HEAD to the host name or address of the first node}"
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PORT=${PORT:-29500}
CLUSTER_FILE=${CLUSTER_FILE:-cluster-${NNODES}x${GPUS_PER_NODE}.json}

run() {
    python -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
        --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "${RDZV_ID:-megatron-auto}" \
        "$@"
}

# The cluster file is written by rank 0, on the first node; copy it to the others (or use a
# shared directory) before planning there.
if [ ! -f "$CLUSTER_FILE" ]; then
    run -m megatron_auto.cli profile-hardware --out "$CLUSTER_FILE"
fi
run pretrain_gpt.py --auto-parallel --cluster "$CLUSTER_FILE" "$@"
