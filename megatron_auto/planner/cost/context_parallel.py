"""Context parallelism in the cost model: a CP layer's attention communication and what it
changes in the layer's time and memory (docs/cost_model.md §11).

Under a layout with ``cp > 1`` each rank holds ``1/cp`` of every sample's tokens (two of ``2cp``
chunks, ``layout.cp_chunks``) of ``cp`` times as many samples as its batch slice alone would
give. The cost model's "samples per rank" are *sample equivalents*: ``b / dp_size`` with
``dp_size = n/tp`` the DP group (``dp x cp``), so that the per-sample profile numbers (compute,
kept bytes, TP messages, relayouts, p2p) scale as they do without CP. What CP adds is priced
here, as the runtime issues it (``parallel/context_parallel.py``):

- ``ring`` (Megatron's ``p2p``): ``cp`` steps, each computing this rank's queries against the
  keys and values of one CP rank -- with the load-balanced order every step is the work of a
  causal (or full) attention of length ``s/cp`` -- while the next step's keys and values travel
  one hop around the ring (``cp - 1`` sends of both, in the compute dtype) overlapped with it.
  Backward passes the keys and values around again (``cp - 1`` sends) and the fp32 dK/dV
  accumulators after them (``cp`` sends: the last brings them home), each overlapped with the
  next step's computation; the last is exposed. The ring keeps no score matrix
  (``attention_kept_quadratic_bytes`` is not kept) and holds a few chunk buffers while it runs.
- ``ulysses`` (``a2a``): all-to-all of the queries, keys and values from sequence- to
  head-sharded before attention and of its output back (4 in forward, 4 in backward), not
  overlapped; attention then runs on the whole sequence with ``heads/cp`` heads.

With ``recompute`` the backward re-runs the forward, its communication included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...layout import Collective, Layout, cp_block_size
from ..inputs.cluster_model import ClusterModel
from ..inputs.profile_records import LayerTypeProfile

# The ring's dK/dV accumulators (and dQ) are fp32 whatever the compute dtype, so that a
# rank's gradient is summed over the ring in full precision.
ACCUMULATOR_BYTES = 4


def _cp_collective(kind: str, layout: Layout, stage_size: int, nbytes: float) -> Collective:
    # A CP group has one rank of every block: members n/cp apart, adjacent when blocks are
    # single ranks; placed over the whole stage.
    return Collective(kind, layout.cp, cp_block_size(layout, stage_size) == 1, float(nbytes))


def cp_attention_collectives(layout: Layout, stage_size: int, cp_mode: str, q_bytes: float,
                             kv_bytes: float, compute_bytes: int, *, recompute: bool = False
                             ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` CP collectives of one rank for one micro-batch of a layer:
    ``q_bytes`` its queries (and the attention output: as wide), ``kv_bytes`` its keys (as
    many values), in the compute dtype of ``compute_bytes`` per element. Ring: ``cp_send`` of
    keys and values together (``cp - 1``), backward those again and ``cp`` of the fp32 dK/dV;
    Ulysses: four ``all_to_all`` each way. Nothing without CP."""
    cp = layout.cp
    if cp == 1:
        return (), ()
    if cp_mode == "ring":
        kv = _cp_collective("cp_send", layout, stage_size, 2 * kv_bytes)
        dkv = _cp_collective("cp_send", layout, stage_size,
                             2 * kv_bytes * ACCUMULATOR_BYTES / compute_bytes)
        forward: tuple[Collective, ...] = (kv,) * (cp - 1)
        backward: tuple[Collective, ...] = (kv,) * (cp - 1) + (dkv,) * cp
    elif cp_mode == "ulysses":
        q = _cp_collective("all_to_all", layout, stage_size, q_bytes)
        k = _cp_collective("all_to_all", layout, stage_size, kv_bytes)
        forward = (q, k, k, q)  # queries, keys, values in; the output back
        backward = (q, q, k, k)  # the output's gradient in; those of q, k, v back
    else:
        raise ValueError(f"cp_mode={cp_mode!r}: choose ring or ulysses")
    return forward, (forward if recompute else ()) + backward


@dataclass(frozen=True)
class CPTime:
    """Seconds a CP layer adds to (or removes from) one micro-batch: ``forward_compute`` and
    ``backward_compute`` change the layer's compute (ring: the attention on ``s/cp``-long
    chunks in place of the whole sequence's), ``forward_comm``/``backward_comm`` is the CP
    communication left exposed, ``comm`` all of it (for the report)."""

    forward_compute: float = 0.0
    backward_compute: float = 0.0
    forward_comm: float = 0.0
    backward_comm: float = 0.0
    comm: float = 0.0


def _overlap(comm: float, compute: float, slowdown: float) -> float:
    return max(comm, compute) + (slowdown - 1.0) * min(comm, compute)


def cp_layer_time(profile: LayerTypeProfile, cluster: ClusterModel, layout: Layout, cp_mode: str,
                  samples: float, stage_size: int, compute_bytes: int,
                  recompute: bool) -> CPTime:
    """What CP changes in one layer's time for ``samples`` sample equivalents per rank (see
    the module docstring). Zero without CP."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return CPTime()
    q_bytes = profile.hidden_bytes_per_sample * samples / tp
    kv_bytes = profile.kv_bytes * samples / tp
    forward, backward = cp_attention_collectives(layout, stage_size, cp_mode, q_bytes, kv_bytes,
                                                 compute_bytes)
    price = lambda c: getattr(cluster, "cp_send_time" if c.kind == "cp_send"  # noqa: E731
                              else "alltoall_time")(c.nbytes, c.group_size, c.consecutive,
                                                    span=c.span or stage_size)
    fwd_all = sum(price(c) for c in forward)
    bwd_all = sum(price(c) for c in backward)
    r = profile.backward_forward_ratio
    if cp_mode == "ulysses":
        # attention on the whole sequence with heads/cp heads: the same work per rank
        f_comm, b_comm, f_compute = fwd_all, bwd_all, 0.0
    else:
        seq_length = profile.attention_seq_length
        whole = profile.attention_time(seq_length, samples, tp)
        # each of the cp steps: a length-s/cp attention for each of the cp x samples samples
        step = profile.attention_time(seq_length / cp, samples * cp, tp)
        f_compute = cp * step - whole
        g = cluster.overlap_slowdown
        kv_t = price(forward[0])
        dkv_t = price(backward[-1])
        f_comm = (cp - 1) * (_overlap(kv_t, step, g) - step)
        # backward step i overlaps the keys and values of step i + 1 and the accumulators of
        # step i - 1 with its own computation; the last accumulators come home exposed
        b_comm = dkv_t
        for i in range(cp):
            moving = (kv_t if i < cp - 1 else 0.0) + (dkv_t if i > 0 else 0.0)
            b_comm += _overlap(moving, r * step, g) - r * step
    b_compute = r * f_compute
    if recompute:
        b_compute += f_compute
        b_comm += f_comm
    return CPTime(f_compute, b_compute, f_comm, b_comm,
                  fwd_all + bwd_all + (fwd_all if recompute else 0.0))


def cp_kept_reduction(profile: LayerTypeProfile, tp: int, cp: int, cp_mode: str) -> float:
    """Kept bytes per sample equivalent a CP layer does not keep: ring attention keeps no
    score matrix (``attention_kept_quadratic_bytes``, split over TP with the heads)."""
    if cp == 1 or cp_mode != "ring":
        return 0.0
    return profile.attention_kept_quadratic_bytes / tp


def cp_transient_bytes(profile: LayerTypeProfile, tp: int, cp: int, cp_mode: str,
                       samples: float, compute_bytes: int) -> float:
    """Bytes a CP layer's attention holds beside its kept activations while it runs, on one
    rank. Ring backward (its larger phase): the received keys and values, the dK/dV
    accumulator being added to and the one arriving (fp32), and the fp32 dQ accumulator.
    Ulysses: the head-sharded copies of queries, keys and values and of the output (as large
    as the sequence-sharded ones), and the sequence-ordered copies attention runs on."""
    if cp == 1:
        return 0.0
    q = profile.hidden_bytes_per_sample * samples / tp
    kv = profile.kv_bytes * samples / tp
    wide = ACCUMULATOR_BYTES / compute_bytes
    if cp_mode == "ring":
        return 2 * kv + 2 * (2 * kv * wide) + q * wide
    return 2 * (2 * q + 2 * kv)
