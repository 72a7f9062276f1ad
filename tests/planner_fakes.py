"""A tiny cluster and profile with round numbers, for hand-calculated planner tests.

The fake cluster has the ClusterSpec methods the planner calls, with ring formulas, one
bandwidth for every group, no latency and no overlap slowdown, so expected values can be worked
out by hand in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_auto.planner.inputs.profile_records import EmbeddingProfile, LayerTypeProfile
from megatron_auto.planner.inputs.profiles import ModelProfile


@dataclass(frozen=True)
class FakeCluster:
    num_nodes: int = 1
    devices_per_node: int = 2
    bandwidth: float = 1e4  # bytes/s for every collective and p2p
    memory_reserve_bytes: int = 1000
    overlap_slowdown: float = 1.0
    device_memory_bytes: int = 10 ** 6
    name: str = "fake"
    peak_flops: dict = field(default_factory=lambda: {"bf16": 1e12, "fp32": 1e12})
    compute_efficiency: float = 1.0
    optimizer_time_per_parameter_s: float = 0.0
    step_overhead_s: float = 0.0

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def flops(self, precision: str) -> float:
        return self.peak_flops[precision] * self.compute_efficiency

    def allreduce_time(self, nbytes, group_size, consecutive=True, span=None):
        if group_size <= 1:
            return 0.0
        return 2 * (group_size - 1) / group_size * nbytes / self.bandwidth

    def allgather_time(self, nbytes_total, group_size, consecutive=True, span=None):
        if group_size <= 1:
            return 0.0
        return (group_size - 1) / group_size * nbytes_total / self.bandwidth

    def reduce_scatter_time(self, nbytes_total, group_size, consecutive=True, span=None):
        return self.allgather_time(nbytes_total, group_size, consecutive, span)

    def zero_gather_time(self, nbytes_total, group_size, consecutive=True, span=None):
        return self.allgather_time(nbytes_total, group_size, consecutive, span)

    def zero_scatter_time(self, nbytes_total, group_size, consecutive=True, span=None):
        return self.allgather_time(nbytes_total, group_size, consecutive, span)

    def p2p_time(self, nbytes, pp_size):
        return 0.0 if pp_size <= 1 else nbytes / self.bandwidth

    def cp_send_time(self, nbytes, group_size, consecutive=True, span=None):
        return 0.0 if group_size <= 1 else nbytes / self.bandwidth

    def alltoall_time(self, nbytes, group_size, consecutive=True, span=None):
        return self.allgather_time(nbytes, group_size, consecutive, span)


def round_profile(precision: str = "bf16") -> ModelProfile:
    """Layer: 1000 parameters, 0.01 s forward per sample, 100 B kept per sample (10 B when
    recomputing), 50 B hidden per sample. Embedding 500 params, head 20 params (tied), head
    forward 0.005 s per sample, 10 B embedding and 40 B head activations per sample, 80 B
    transient per sample for the loss."""
    layer = LayerTypeProfile(
        name="gpt", parameter_count=1000, forward_time_per_sample_s=0.01,
        activation_replicated_bytes=100.0, activation_split_bytes=0.0,
        recompute_bytes_per_sample=10.0, hidden_bytes_per_sample=50.0)
    emb = EmbeddingProfile(
        embedding_parameters=500, head_parameters=20, tied=True, vocab_size=64,
        hidden_bytes_per_sample=50.0, embedding_forward_time_per_sample_s=0.0,
        head_forward_time_per_sample_s=0.005, embedding_activation_bytes=10.0,
        head_activation_replicated_bytes=0.0, head_activation_split_bytes=40.0,
        head_transient_split_bytes=80.0)
    return ModelProfile(layer_types={"gpt": layer}, embedding=emb, precision=precision,
                        source="measured")


def tiny_gpt(world: int, layers: int, batch: int, *, hidden: int = 256, heads: int = 4,
             ffn: int = 1024, seq: int = 16, vocab: int = 256) -> tuple:
    """``(spec, training, cluster, profile)`` of the offload enumeration tests: an fp32 GPT of
    ``layers`` layers on ``world`` A100-40G devices of 1 GB each (100 kB reserve, 5 kB per NCCL
    communicator), priced by the analytic profile."""
    import dataclasses

    from megatron_auto.planner import ModelSpec, TrainingSpec, analytic_profile
    from megatron_auto.planner.inputs.model_spec import LayerType
    from megatron_auto.planner.inputs.presets import make_cluster

    lt = LayerType(name="gpt", hidden_size=hidden, num_attention_heads=heads,
                   ffn_hidden_size=ffn, seq_length=seq, count=layers)
    spec = ModelSpec(layer_types=(lt,), layer_order=(0,) * layers, vocab_size=vocab,
                     embedding_hidden_size=hidden, seq_length=seq, name="gpt")
    training = TrainingSpec(batch, "fp32")
    cluster = dataclasses.replace(make_cluster("a100-40g", 1, world), memory_reserve_bytes=10 ** 5,
                                  device_memory_bytes=10 ** 9, nccl_communicator_bytes=5e3)
    return spec, training, cluster, analytic_profile(spec, training, cluster)


class Ticks:
    """A search clock (``search_cache.SearchClock``'s stand-in) that advances one second per
    read: ``time_limit_s = n`` stops a search at its n-th deadline check, at the same node on
    any machine."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads)
