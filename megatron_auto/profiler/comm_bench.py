"""Timing primitives of the hardware profiler: collectives, p2p hops, matmuls and their overlap.

Every function here is collective over the world (all ranks call it with the same arguments, in
the same order) and returns the same numbers on every rank: each rank times its own part, then
the world takes the maximum (the slowest rank paces a synchronous step). Devices are synchronised
around each timed loop (``torch.cuda.synchronize`` on GPU; CPU collectives are synchronous unless
``async_op=True``).

Cost model the fit serves (nccl-tests "bus bandwidth" convention, as in planner/inputs/hardware.py)::

    t(S) = latency + factor(op, g) * S / busbw
    factor: all-reduce 2(g-1)/g (S = the tensor), all-gather and reduce-scatter (g-1)/g
    (S = the gathered / unsharded total), p2p 1 (S = the message)

:func:`fit_latency_bandwidth` solves it by least squares over several message sizes.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..parallel.comm import all_gather_into_tensor, reduce_scatter_tensor
from ..parallel.grad_norm import NormEntry, clip_grads_, global_grad_norm
from ..parallel.optimizer import OptimizerConfig, build_optimizer
from .timing import sync, time_rounds

OPS = ("allreduce", "allgather", "reduce_scatter")


def bus_factor(op: str, group_size: int) -> float:
    """The ``factor`` of the module docstring: bytes each link carries per byte of ``S``."""
    g = group_size
    if op == "allreduce":
        return 2.0 * (g - 1) / g
    if op in ("allgather", "reduce_scatter"):
        return (g - 1) / g
    if op == "p2p":
        return 1.0
    raise ValueError(f"op={op!r}: unknown; choose one of {', '.join(OPS + ('p2p',))}")


def fit_latency_bandwidth(effective_bytes: Sequence[float],
                          times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = latency + x / bandwidth``; returns ``(latency_s, bandwidth)``.

    ``effective_bytes`` are the ``x = factor * S`` of each message. With one size, or when noise
    makes the slope non-positive, the bandwidth of the largest message alone is used and the
    latency is the smallest message's time (an upper bound). The latency is floored at 0.
    """
    x = np.asarray(effective_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if x.shape != t.shape or x.size == 0:
        raise ValueError(f"fit needs matching, non-empty sizes and times; got {x.size} sizes and "
                         f"{t.size} times")
    if np.any(t <= 0) or np.any(x <= 0):
        raise ValueError(f"fit needs positive sizes and times; got sizes {x.tolist()} and times "
                         f"{t.tolist()}")
    if x.size >= 2 and np.ptp(x) > 0:
        design = np.stack([np.ones_like(x), x], axis=1)
        (latency, slope), *_ = np.linalg.lstsq(design, t, rcond=None)
        if slope > 0:
            # Intercept below zero means noise on tiny messages: the line through the largest
            # message with zero latency is then the better description.
            if latency < 0:
                return 0.0, float(x.max() / t[np.argmax(x)])
            return float(latency), float(1.0 / slope)
    big = int(np.argmax(x))
    return float(t[np.argmin(x)] if x.size >= 2 else 0.0), float(x[big] / t[big])


# --------------------------------------------------------------------------- timing helpers
def world_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (the same list on every rank)."""
    buf = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.cpu().tolist()


def world_barrier(device: torch.device) -> None:
    """A barrier made of a one-element all-reduce (works the same on gloo and nccl)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(torch.zeros(1, device=device))
    sync(device)


def time_loop(step: Callable[[], Any], warmup: int, iters: int, device: torch.device,
              before: Callable[[], Any] | None = None) -> float:
    """Seconds per call of ``step`` on this rank: the median of ``iters`` timed calls.

    The median (not the mean) because a shared machine's scheduler hiccups land on single calls;
    each call is synchronised so that it is timed alone. ``before`` (untimed) runs ahead of
    every call: see :func:`compute_gap`. No barrier: the ranks run their calls back to back.
    """
    return time_calls([step], warmup, iters, device, before, barrier=False)[0]


def time_calls(steps: Sequence[Callable[[], Any]], warmup: int, iters: int,
               device: torch.device, before: Callable[[], Any] | None = None,
               barrier: bool = True) -> list[float]:
    """Seconds per call of each of ``steps`` on this rank: the profilers' one timing loop
    (:func:`~.timing.time_rounds`, every message size once per round) with each round started
    from a world barrier (unless ``barrier`` is false) and ``before`` (untimed) ahead of every
    call."""
    rounds = time_rounds([(step,) for step in steps], warmup, iters, device, before=before,
                         barrier=(lambda: world_barrier(device)) if barrier else None)
    return [seconds for (seconds,) in rounds]


def compute_gap(device: torch.device) -> Callable[[], None]:
    """About a millisecond of matmuls to run (untimed) before each timed communication call.

    Training issues its collectives and p2p hops between pieces of compute, never back to back.
    Timed in a tight loop the ranks stay in lockstep and the transport's threads stay awake, so
    a call looks cheaper than it is in a step: on 2 CPU ranks a 256 KiB gloo all-reduce took
    1.7 ms back to back, 2.5 ms after a millisecond of matmuls, and 2.8 ms inside a TP=2
    training step. Timing each call after such a gap measures what a step pays (the ranks'
    drift included). On a GPU the gap costs microseconds and changes little.
    """
    size = 2048 if device.type == "cuda" else 256
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)

    def gap() -> None:
        for _ in range(2):
            torch.mm(a, b)
    return gap


def collective_step(op: str, nbytes: int, group: Any, group_size: int, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> Callable[[], Any]:
    """A closure running one ``op`` with total size ``nbytes`` (see ``bus_factor`` for which)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(group_size, nbytes // elem // group_size * group_size)
    if op == "allreduce":
        buf = torch.zeros(numel, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "allgather":
        out = torch.empty(numel, dtype=dtype, device=device)
        shard = torch.zeros(numel // group_size, dtype=dtype, device=device)
        return lambda: all_gather_into_tensor(out, shard, group=group)
    if op == "reduce_scatter":
        inp = torch.zeros(numel, dtype=dtype, device=device)
        shard = torch.empty(numel // group_size, dtype=dtype, device=device)
        return lambda: reduce_scatter_tensor(shard, inp, group=group)
    raise ValueError(f"op={op!r}: unknown; choose one of {', '.join(OPS)}")


def p2p_step(nbytes: int, peer: int | None, sender: bool,
             device: torch.device) -> Callable[[], None]:
    """One one-way message of ``nbytes`` to/from ``peer`` (a no-op for ranks without a peer)."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)

    def step() -> None:
        if peer is None:
            return
        if sender:
            dist.send(buf, dst=peer)
        else:
            dist.recv(buf, src=peer)
    return step


# --------------------------------------------------------------------------------- compute
def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, iters: int) -> float:
    """FLOP/s of this rank's ``size``^3 matmul in ``dtype`` (2 size^3 FLOPs per product)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = time_loop(lambda: torch.mm(a, b), 1, iters, device)
    return 2.0 * size**3 / seconds


# --------------------------------------------------------------------------------- overlap
def overlap_slowdown(device: torch.device, matmul_size: int, comm_bytes: int,
                     comm_iters: int, repeats: int = 3) -> dict[str, float]:
    """Slowdown of compute and communication when they run at the same time.

    Times a matmul loop alone, an all-reduce loop (world group) alone, then both concurrently:
    on GPU the all-reduces run on a side stream; on CPU they are issued with ``async_op=True``
    (gloo's worker threads progress them) while this thread multiplies, and a waiter thread
    records when the last one completes. The matmul count is chosen so both loops take about
    the same time alone, so each can be slowed by the other over its whole length.
    ``slowdown = max(compute_concurrent / compute_alone, comm_concurrent / comm_alone)``,
    floored at 1, median over ``repeats``, maximum over ranks. 1.0 on a world of one.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return {"slowdown": 1.0, "compute_alone_s": 0.0, "comm_alone_s": 0.0}
    a = torch.randn(matmul_size, matmul_size, device=device)
    b = torch.randn(matmul_size, matmul_size, device=device)
    buf = torch.zeros(max(1, comm_bytes // 4), device=device)
    world_barrier(device)
    one_mm = world_max([time_loop(lambda: torch.mm(a, b), 1, 3, device)], device)[0]
    world_barrier(device)
    comm_alone = world_max([time_loop(lambda: dist.all_reduce(buf), 1, comm_iters, device)
                            * comm_iters], device)[0]
    num_mm = max(1, round(comm_alone / max(one_mm, 1e-9)))

    def compute_loop() -> None:
        for _ in range(num_mm):
            torch.mm(a, b)

    ratios: list[float] = []
    details = {"compute_alone_s": 0.0, "comm_alone_s": comm_alone, "num_matmuls": float(num_mm)}
    for _ in range(repeats):
        world_barrier(device)
        compute_alone = time_loop(compute_loop, 0, 1, device)
        world_barrier(device)
        comm_alone = time_loop(lambda: [dist.all_reduce(buf) for _ in range(comm_iters)], 0, 1,
                               device)
        world_barrier(device)
        compute_conc, comm_conc = (_concurrent_cuda if device.type == "cuda" else _concurrent_cpu)(
            compute_loop, buf, comm_iters, device)
        c_alone, m_alone, c_conc, m_conc = world_max(
            [compute_alone, comm_alone, compute_conc, comm_conc], device)
        ratios.append(max(1.0, c_conc / c_alone, m_conc / m_alone))
        details.update(compute_alone_s=c_alone, comm_alone_s=m_alone,
                       compute_concurrent_s=c_conc, comm_concurrent_s=m_conc)
    details["slowdown"] = float(np.median(ratios))
    return details


def _concurrent_cpu(compute_loop: Callable[[], None], buf: torch.Tensor, comm_iters: int,
                    device: torch.device) -> tuple[float, float]:
    done: dict[str, float] = {}
    start = time.perf_counter()
    handles = [dist.all_reduce(buf, async_op=True) for _ in range(comm_iters)]

    def wait_all() -> None:
        # Work.wait releases the GIL, so this thread sleeps while the main thread computes.
        for handle in handles:
            handle.wait()
        done["comm"] = time.perf_counter() - start

    waiter = threading.Thread(target=wait_all, daemon=True)
    waiter.start()
    compute_loop()
    compute_s = time.perf_counter() - start
    waiter.join()
    return compute_s, done["comm"]


def _concurrent_cuda(compute_loop: Callable[[], None], buf: torch.Tensor, comm_iters: int,
                     device: torch.device) -> tuple[float, float]:
    side = torch.cuda.Stream(device=device)
    main = torch.cuda.current_stream(device)
    begin = torch.cuda.Event(enable_timing=True)
    compute_end = torch.cuda.Event(enable_timing=True)
    comm_end = torch.cuda.Event(enable_timing=True)
    begin.record(main)
    side.wait_event(begin)
    with torch.cuda.stream(side):
        for _ in range(comm_iters):
            dist.all_reduce(buf)  # enqueued; makes `side` wait for NCCL's stream
        comm_end.record(side)
    compute_loop()
    compute_end.record(main)
    torch.cuda.synchronize(device)
    return begin.elapsed_time(compute_end) / 1e3, begin.elapsed_time(comm_end) / 1e3


# ------------------------------------------------------------------- the runtime's own steps
def zero_collectives(device: torch.device, sizes: Sequence[int], warmup: int, iters: int,
                     num_modules: int = 4) -> list[tuple[int, float, float]]:
    """``(bytes, gather_s, scatter_s)`` per size: ZeRO's all-gather and reduce-scatter of one
    unit of ``bytes`` fp32 parameters over the world, as the runtime issues them.

    The runtime's ZeRO is FSDP2 (``parallel/data_parallel.py``), whose collectives carry more
    than the raw all-gather: copy-in/copy-out of the flat buffer, DTensor bookkeeping, the
    pre/post hooks. So this runs one forward and backward of ``num_modules`` layer-like units
    (:func:`_layer_like`, a :func:`compute_gap` before each in both directions, as between a
    model's layers) in the runtime's three ways: unsharded, ``zero2`` (``fully_shard`` keeping
    the parameters gathered from forward to the end of backward: one gather per unit in forward,
    one reduce-scatter per unit in backward) and ``zero3`` (resharding after forward: the
    forward's gathers are the same). Per unit, ``gather`` = the sharded forwards minus the
    unsharded one, ``scatter`` = the ``zero2`` backward minus the unsharded one: each a
    collective alone, not one inferred from another. The three run in turn inside each round
    (so a change of load hits all of them), each round's time is the slowest rank's (it paces a
    step; taking the maximum of per-rank differences instead counts every rank's scheduler noise
    as communication), and the median of the rounds' differences is kept. Empty on a world of
    one.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return []
    # lazy: torch.distributed.fsdp pulls in torch.distributed.tensor (~1 s); only worlds > 1
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    gap = compute_gap(device)
    modes = ("plain", "zero2", "zero3")
    sizes_out, samples = [], []  # samples: per size, per mode, (forward, backward) per round
    for nbytes in sizes:
        width = max(world, int((nbytes // 16) ** 0.5) // world * world)  # 4 w^2 fp32 weights
        variants = {}
        for mode in modes:
            torch.manual_seed(0)
            units = torch.nn.ModuleList([_layer_like(width, device) for _ in range(num_modules)])
            if mode != "plain":
                for unit in units:
                    fully_shard(unit, mesh=mesh, reshard_after_forward=mode == "zero3")
                    unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            variants[mode] = units
        x = torch.randn(1, width, device=device)
        rounds: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
        for i in range(warmup + iters):
            for mode in modes:
                timed = _units_step(variants[mode], x, gap, device)
                if i >= warmup:
                    rounds[mode].append(timed)
        del variants
        sizes_out.append(4 * (4 * width * width + 8 * width))
        samples.append(rounds)
    flat = [t for rounds in samples for mode in modes for pair in rounds[mode] for t in pair]
    flat = world_max(flat, device)  # each round's forward/backward as the slowest rank took it
    out, pos = [], 0
    for nbytes, rounds in zip(sizes_out, samples):
        per_mode = {}
        for mode in modes:
            n = len(rounds[mode])
            per_mode[mode] = np.asarray(flat[pos:pos + 2 * n]).reshape(n, 2)
            pos += 2 * n
        plain, zero2, zero3 = per_mode["plain"], per_mode["zero2"], per_mode["zero3"]
        gather = np.median(((zero2[:, 0] + zero3[:, 0]) / 2 - plain[:, 0]) / num_modules)
        scatter = np.median((zero2[:, 1] - plain[:, 1]) / num_modules)
        out.append((nbytes, max(1e-7, float(gather)), max(1e-7, float(scatter))))
    return out


def _units_step(units: torch.nn.ModuleList, x: torch.Tensor, gap: Callable[[], None],
                device: torch.device) -> tuple[float, float]:
    """Seconds of one forward and one backward through ``units``, from a barrier."""
    world_barrier(device)
    start = time.perf_counter()
    y = x
    for unit in units:  # compute between the units, as between a model's layers
        y = unit(_ComputeGap.apply(y, gap))
    sync(device)
    middle = time.perf_counter()
    y.sum().backward()
    sync(device)
    return middle - start, time.perf_counter() - middle


def _layer_like(width: int, device: torch.device) -> torch.nn.Module:
    """A unit with a transformer layer's twelve parameter tensors (four weight matrices, their
    biases, two norms): FSDP2's per-tensor work (views, copies, DTensor wrapping) is part of
    what the runtime pays, so the unit has as many tensors as a layer, not one."""
    return torch.nn.Sequential(
        torch.nn.LayerNorm(width, device=device), torch.nn.Linear(width, width, device=device),
        torch.nn.Linear(width, width, device=device), torch.nn.LayerNorm(width, device=device),
        torch.nn.Linear(width, width, device=device), torch.nn.Linear(width, width, device=device))


class _ComputeGap(torch.autograd.Function):
    """Identity that runs ``gap()`` in forward and again in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gap: Callable[[], None]) -> torch.Tensor:
        ctx.gap = gap
        gap()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.gap()
        return grad, None


def optimizer_step_times(device: torch.device, counts: Sequence[int], warmup: int,
                         iters: int) -> list[tuple[int, float]]:
    """``(parameters, seconds)`` of the training step after backward on ``parameters`` fp32
    parameters shaped like transformer weights: the global gradient norm (with its scalar
    all-reduce), clipping, and the runtime's AdamW (``parallel/optimizer.py``)."""
    out = []
    for count in counts:
        width = max(8, int((count / 4) ** 0.5))
        params = [torch.nn.Parameter(torch.randn(width, width, device=device)) for _ in range(4)]
        params.append(torch.nn.Parameter(torch.randn(width, device=device)))  # a no-decay group
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = build_optimizer(params, OptimizerConfig(), lr=1e-4)

        def step() -> None:
            norm = global_grad_norm([NormEntry(p.grad, True) for p in params], device=device)
            # Clip every time (the costlier branch) by a hair, so gradients keep their size.
            clip_grads_([p.grad for p in params], norm * 0.999, norm)
            optimizer.step()

        world_barrier(device)
        seconds = time_loop(step, max(1, warmup), iters, device)
        out.append((sum(p.numel() for p in params), seconds))
        del optimizer, params
    times = world_max([t for _, t in out], device)
    return [(n, times[i]) for i, (n, _) in enumerate(out)]
