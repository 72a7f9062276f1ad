"""The multi-node path on one machine: two torchrun agents (``--nnodes 2``) meeting at a c10d
rendezvous on localhost, as two hosts would (docs/multinode.md).

Each agent is its own "node": torchrun gives its workers ``GROUP_RANK`` 0 or 1 and
``LOCAL_WORLD_SIZE``, which is all the profiler and the runtime learn about nodes, so the code
that runs here is the code that runs across real hosts (only the wire is loopback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port
from megatron_auto.planner.inputs.hardware import ClusterSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300


def _two_nodes(tmp_path, nproc_per_node: int, command: list[str]) -> list[subprocess.CompletedProcess]:
    """Start two torchrun agents on this machine, wait for both, return their results."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "multinode-test",
               # The first agent hosts the rendezvous store, as the head node of a job would.
               "--rdzv-conf", f"is_host={1 if node == 0 else 0}", "--local-addr", "127.0.0.1",
               *command]
        agents.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return results


@pytest.mark.multirank
def test_hardware_profile_across_two_nodes_writes_a_two_node_cluster(tmp_path):
    cluster, raw = tmp_path / "cluster.json", tmp_path / "raw.json"
    _two_nodes(tmp_path, 2, ["-m", "megatron_auto.cli", "profile-hardware", "--out", str(cluster),
                             "--raw-out", str(raw), "--message-sizes", "4096", "65536",
                             "--iters", "1", "--name", "two-nodes"])
    spec = ClusterSpec.load(cluster)
    assert (spec.name, spec.num_nodes, spec.devices_per_node) == ("two-nodes", 2, 2)
    profile = json.loads(raw.read_text())
    assert [n.split(" (")[0] for n in profile["nodes"]] == ["node 0", "node 1"]
    spans = {(r["op"], r["group_size"], r["consecutive"]): r["nodes_spanned"]
             for r in profile["comm"]}
    # Consecutive pairs stay inside a node; strided pairs {0,2},{1,3} and the world cross.
    assert spans[("allreduce", 2, True)] == 1
    assert spans[("allreduce", 2, False)] == 2 and spans[("allreduce", 4, True)] == 2
    assert {r["group_size"]: r["nodes_spanned"] for r in profile["p2p"]} == {2: 2, 4: 1}  # pp 4: 0->1, 2->3
    across = [r for r in profile["comm"] if r["nodes_spanned"] == 2]
    assert all(r["busbw"] > 0 for r in across)
    assert spec.intra_node_busbw > 0 and spec.inter_node_bw_per_device > 0


@pytest.mark.multirank
def test_training_across_two_nodes_with_a_pipeline_hop_between_them(tmp_path):
    metrics = tmp_path / "m.jsonl"
    results = _two_nodes(tmp_path, 1, [
        os.path.join(ROOT, "pretrain_gpt.py"), "--mock-data", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
        "--eval-interval", "100", "--metrics-file", str(metrics)])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["lm_loss"] > 0 for r in records)
    # Node 0's agent runs rank 0, which prints; the other node stays quiet.
    printed = [r for r in results if " iteration " in r.stdout]
    assert len(printed) == 1 and "2 rank(s), plan: pp=2" in printed[0].stdout


def _resolve_in(rank, world_size, directories):
    from megatron_auto.auto import resolve_cluster
    from megatron_auto.planner.inputs.hardware import ClusterError

    os.chdir(directories[rank])  # a relative --cluster path that only rank 0's node has
    try:
        return resolve_cluster("cluster.json", world_size, Path(directories[rank])).to_dict()
    except ClusterError as err:
        return f"error: {err}"


@pytest.mark.multirank
def test_cluster_file_is_needed_on_the_first_node_only(tmp_path):
    from dist_utils import run_distributed
    from megatron_auto.planner.inputs.presets import get_cluster

    head, other = tmp_path / "head", tmp_path / "other"
    head.mkdir()
    other.mkdir()
    get_cluster("a100-40g-1x8").save(head / "cluster.json")
    on_head, on_other = run_distributed(_resolve_in, 2, [str(head), str(other)])
    assert on_head == on_other == get_cluster("a100-40g-1x8").to_dict()
    # Missing on the first node: every rank stops with rank 0's error (none waits forever).
    errors = run_distributed(_resolve_in, 2, [str(other), str(head)])
    assert errors[0] == errors[1] and errors[0].startswith("error: ") and "cluster.json" in errors[0]


@pytest.mark.pure
@pytest.mark.parametrize("script", ["examples/slurm/pretrain_gpt.sbatch",
                                    "examples/torchrun_two_nodes.sh"])
def test_launch_scripts_parse(script):
    # No scheduler or second host here: at least the shell must accept the scripts.
    proc = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
