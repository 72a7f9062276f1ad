"""Predicted against measured peak memory and iteration time, for plans of every kind.

Runs on CPU with gloo (or GPUs with NCCL when present): it measures the hardware and the model
once (the same profilers ``--auto-parallel`` uses), prices each plan with the planner's cost
model, trains it for a few iterations with ``pretrain_gpt.py --plan``, and prints the predicted
and measured peak memory (max over ranks) and iteration time (median of the measured
iterations after the first), with the relative errors::

    python benchmarks/validate_cost_model.py                 # one rank per core, >= 9 plans
    python benchmarks/validate_cost_model.py --nproc 8 --iters 10
    python benchmarks/validate_cost_model.py --reprice DIR   # a finished run's work dir, priced
                                                             # again by the current cost model

Targets on CPU (issues 5, 11, 13): memory error <= 10% for every plan (sequence-parallel,
interleaved and ZeRO-1 plans included) and never an under-estimate by more than 5%; iteration-time
error <= 25% for every plan, median <= 10%. Each row records the machine's load average while the
plan trained (and the table the load while profiling): on a shared machine wall times swing 3-5x
with it, so rows measured at a load far from the profiling one compare two different machines. It then calibrates the cost model (the fit of
``megatron-auto calibrate``) leave-one-out: fitted on all plans but one and judged on that one.
The script prints what it measured; it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_auto.config import ModelConfig  # noqa: E402
from megatron_auto.families.gpt.config import MoEConfig  # noqa: E402
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy  # noqa: E402
from megatron_auto.planner.inputs.hardware import ClusterSpec  # noqa: E402
from megatron_auto.planner.inputs.model_spec import TrainingSpec  # noqa: E402
from megatron_auto.families.registry import model_spec, spec_of_record  # noqa: E402
from megatron_auto.planner.search.driver import evaluate  # noqa: E402
from megatron_auto.planner.calibrate import (apply_calibration, fit_calibration,  # noqa: E402
                                              load_run)

MODEL = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64,
                    max_position_embeddings=64, vocab_size=2048, hidden_dropout=0.0,
                    attention_dropout=0.0)
GLOBAL_BATCH = 16
# The MoE plans' model (names starting "moe-"): MODEL's shape with every other layer MoE (4
# experts of 256, top-2, no biases, which MoE layers refuse), so that its dense layers give the
# measured clock the derived MoE layer type runs on (profiles.with_analytic_layer_types).
MOE_MODEL = dataclasses.replace(MODEL, add_bias_linear=False, moe=MoEConfig(
    num_experts=4, router_topk=2, ffn_hidden_size=256, layer_freq=2))
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
             "--moe-layer-freq", "2", "--disable-bias-linear"]


def model_of(name: str) -> ModelConfig:
    """The model a named plan trains."""
    return MOE_MODEL if name.startswith("moe-") else MODEL


def _layer(tp: int = 1, dp: str = "ddp", consec: bool = True, rc: Any = False,
           sp: bool = False, cp: int = 1, cp_mode: str = "ring") -> LayerStrategy:
    return LayerStrategy(tp=tp, dp_mode=dp, tp_consecutive=consec, recompute=rc,
                         sequence_parallel=sp, cp=cp, cp_mode=cp_mode)


def plans(world: int) -> dict[str, Plan]:
    """Named plans covering pp, tp, every DP flavour (zero1 included), strided TP, sequence
    parallelism, recompute, both schedules, the interleaved one (virtual pipeline), ring
    context parallelism and an expert-parallel plan of :data:`MOE_MODEL` (``moe-``)."""
    n = MODEL.num_layers

    def make(layers, pp=1, lps=None, m=2, schedule="1f1b", vocab=VocabStrategy(), v=1):
        if pp > world or any(layer.tp > world // pp for layer in layers) or \
                vocab.tp > world // pp:
            return None  # this plan needs more ranks than the run has
        return Plan(world_size=world, global_batch_size=GLOBAL_BATCH, num_microbatches=m,
                    pipeline=PipelineSpec(size=pp, schedule=schedule, virtual_size=v,
                                          layers_per_stage=tuple(lps or (n // (pp * v),) * pp * v)),
                    vocab=vocab, layers=tuple(layers))

    tp_pp = 2 if world >= 4 else 1  # TP inside each pipeline stage when there is room
    out = {
        "dp-ddp": make([_layer()] * n),
        "dp-zero2": make([_layer(dp="zero2")] * n, vocab=VocabStrategy(dp_mode="zero2")),
        "dp-zero3": make([_layer(dp="zero3")] * n, vocab=VocabStrategy(dp_mode="zero3")),
        "dp-zero1": make([_layer(dp="zero1")] * n, vocab=VocabStrategy(dp_mode="zero1")),
        "zero2-recompute": make([_layer(dp="zero2", rc=True)] * n),
        "ddp-recompute-half": make([_layer(rc=True), _layer(), _layer(rc=True), _layer()]),
        # module recompute (issue 27): core attention on every layer; per-module lists mixed
        "ddp-selective": make([_layer(rc="selective")] * n),
        "ddp-modules-mixed": make([_layer(rc=["mlp"]), _layer(rc=["core_attn", "mlp"]),
                                   _layer(rc="selective"), _layer()]),
        "tp2": make([_layer(tp=2)] * n, vocab=VocabStrategy(tp=2)),
        f"tp{world}": make([_layer(tp=world)] * n, vocab=VocabStrategy(tp=world)),
        "tp2-sp": make([_layer(tp=2, sp=True)] * n, vocab=VocabStrategy(tp=2)),
        "pp2-1f1b": make([_layer()] * n, pp=2, m=4),
        f"pp2-uneven-gpipe-tp{tp_pp}": make([_layer(tp=tp_pp)] * n, pp=2, lps=(3, 1), m=4,
                                            schedule="gpipe", vocab=VocabStrategy(tp=tp_pp)),
        "pp4-1f1b": make([_layer()] * n, pp=4, m=4),
        "pp2-interleaved-v2": make([_layer()] * n, pp=2, v=2, m=4),
        # context parallelism (issue 24): ring attention, each rank two of four sequence
        # chunks; the activations per rank halve, parameters and optimizer states do not
        "cp2-ring": make([_layer(cp=2)] * n),
        "mixed-per-layer": make([_layer(tp=2), _layer(dp="zero3"), _layer(tp=world),
                                 _layer(tp=2, consec=world <= 2, dp="zero2", rc=True)],
                                vocab=VocabStrategy(tp=2)),
        # MOE_MODEL (layers 0 and 2 MoE): experts split over 2 ranks, their states over the
        # expert-DP group in zero1 where it has ranks (world 4); dense layers ddp
        "moe-ep2": make([LayerStrategy(ep=2, expert_dp_mode="zero1" if world >= 4 else None),
                         _layer()] * (n // 2)) if world % 2 == 0 else None,
    }
    seen, unique = set(), {}
    for name, plan in out.items():  # drop plans this world makes identical (tp2 = tp<world>)
        key = None if plan is None else json.dumps(plan.to_dict(), sort_keys=True)
        if key is not None and key not in seen:
            seen.add(key)
            unique[name] = plan
    return unique


def default_nproc() -> int:
    """One rank per core: the cost model describes ranks that own their device, which CPU
    ranks do only when they do not share cores (see docs/profiling.md)."""
    return max(2, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 2))


def torchrun(nproc: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def auto_parallel_profile(nproc: int, cache_dir: Path, model: ModelConfig = MODEL):
    """The profile the ``--auto-parallel`` run measured (every rank at once, the TP shards up
    to ``nproc`` included), read from its cache. Looking it up with a lone process's default
    settings would miss it (the key holds the TP degrees timed, none on a lone process) and
    measure a second profile alone, without the TP shards and without the other ranks."""
    import torch  # noqa: PLC0415 - after the subprocesses, to keep their start light

    from megatron_auto.profiler import cache as profile_cache  # noqa: PLC0415
    from megatron_auto.profiler.measure import ModelProfilerConfig  # noqa: PLC0415
    from megatron_auto.profiler.model_profiler import profile_cache_key  # noqa: PLC0415

    degrees = []
    for k in range(1, nproc.bit_length()):
        try:
            model.check_tensor_parallel(1 << k)
            degrees.append(1 << k)
        except ValueError:
            pass
    config = ModelProfilerConfig(tp_degrees=tuple(degrees) or None)
    key = profile_cache_key(model, "fp32", torch.device("cpu"), config)
    return profile_cache.load_cached(key, cache_dir)


def model_flags(m: ModelConfig = MODEL) -> list[str]:
    extra = MOE_FLAGS if m.moe is not None else []
    return extra + ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--num-attention-heads", str(m.num_attention_heads), "--seq-length",
            str(m.seq_length), "--max-position-embeddings", str(m.max_position_embeddings),
            "--vocab-size", str(m.vocab_size), "--hidden-dropout", "0", "--attention-dropout",
            "0"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=default_nproc(),
                        help="ranks (default: one per CPU core, at most 4, at least 2)")
    parser.add_argument("--iters", type=int, default=10,
                        help="iterations per plan (the median of those after the second is "
                             "the measured time; default 10)")
    parser.add_argument("--only", nargs="*", default=None, help="plan names to run")
    parser.add_argument("--table-out", default=None, metavar="FILE",
                        help="also write the results as a Markdown table (for docs/)")
    parser.add_argument("--reprice", default=None, metavar="DIR",
                        help="measure nothing: price the plans of an earlier run's work dir "
                             "(its profiles, plans and metrics) with the current cost model")
    args = parser.parse_args()
    if args.reprice:
        return reprice(Path(args.reprice), args.table_out)

    work = Path(tempfile.mkdtemp(prefix="validate_cost_model_"))
    env = dict(os.environ, MEGATRON_AUTO_CACHE=str(work / "cache"), OMP_NUM_THREADS="1")
    print(f"# work dir {work}; {args.nproc} ranks; model {MODEL.num_parameters() / 1e6:.2f} M "
          f"params; global batch {GLOBAL_BATCH}; fp32", flush=True)

    cluster_file = work / "cluster.json"
    profile_load = _load()
    (work / "profile.load").write_text(profile_load)
    print(f"# load average {profile_load} before profiling", flush=True)
    proc = torchrun(args.nproc, ["-m", "megatron_auto.cli", "profile-hardware", "--out",
                                 str(cluster_file), "--raw-out", str(work / "cluster_raw.json")],
                    env)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return 1
    cluster = ClusterSpec.load(cluster_file)
    # Measure the model the way --auto-parallel does (every rank profiling at once, so compute
    # is timed under training's sharing of the cores); the profile lands in the cache.
    proc = torchrun(args.nproc, ["pretrain_gpt.py", "--mock-data", *model_flags(),
                                 "--auto-parallel", "--cluster", str(cluster_file),
                                 "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", "1"],
                    env)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return 1
    import torch  # noqa: PLC0415 - after the subprocesses, to keep their start light

    torch.set_num_threads(1)  # each training rank runs single-threaded, like the profile
    profile = auto_parallel_profile(args.nproc, work / "cache")
    if profile is None:
        print(f"no cached profile of the --auto-parallel run in {work / 'cache'}")
        return 1
    spec = model_spec(MODEL)
    training = TrainingSpec(global_batch_size=GLOBAL_BATCH, precision="fp32")
    chosen = {name: plan for name, plan in plans(args.nproc).items()
              if not args.only or name in args.only}
    priced_by = {MODEL.model_type: (spec, profile)}
    if any(model_of(name) is MOE_MODEL for name in chosen):
        # the MoE model measured as --auto-parallel measures it (its dense layer and router),
        # the MoE layer type derived as --auto-parallel derives it
        from megatron_auto.planner.inputs.profiles import with_analytic_layer_types  # noqa

        proc = torchrun(args.nproc, ["pretrain_gpt.py", "--mock-data", *model_flags(MOE_MODEL),
                                     "--auto-parallel", "--cluster", str(cluster_file),
                                     "--global-batch-size", str(GLOBAL_BATCH),
                                     "--train-iters", "1"], env)
        moe_profile = auto_parallel_profile(args.nproc, work / "cache", MOE_MODEL)
        if proc.returncode or moe_profile is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        moe_spec = model_spec(MOE_MODEL)
        priced_by["moe"] = (moe_spec, with_analytic_layer_types(moe_profile, moe_spec,
                                                                training, cluster))

    rows, runs = [], []
    for name, plan in chosen.items():
        model = model_of(name)
        plan_spec, plan_profile = priced_by["moe" if model is MOE_MODEL else model.model_type]
        est = evaluate(plan, plan_spec, training, cluster, plan_profile)
        plan = Plan.from_dict({**plan.to_dict(), "estimate": est.to_dict(),
                               "model": model.to_dict()})
        plan_file = work / f"{name}.json"
        metrics_file = work / f"{name}.jsonl"
        plan.save(plan_file)
        load = _load()  # the machine's load while this plan trains: shared CPUs swing 3-5x
        proc = torchrun(args.nproc, ["pretrain_gpt.py", "--mock-data", *model_flags(model),
                                     "--plan", str(plan_file), "--train-iters",
                                     str(args.iters), "--log-interval", "1", "--lr", "1e-4",
                                     "--timing-log-level", "1",
                                     "--metrics-file", str(metrics_file)], env)
        if proc.returncode:
            print(f"{name}: FAILED\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
            continue
        records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        # Iterations 1-2 carry the CPU memory tracker's overhead (see training/pretrain.py).
        later = records[2:] or records
        measured_time = statistics.median(r["iteration_time_s"] for r in later)
        measured_mem = max((r.get("peak_memory_bytes") or 0) for r in records)
        pred_time = est.iteration_time_s
        pred_mem = max(s.peak_memory_bytes for s in est.stages)
        rows.append((name, pred_mem, measured_mem, pred_time, measured_time, load))
        (work / f"{name}.load").write_text(load)
        if model is MODEL:  # the calibration below fits the dense model's runs
            runs.append((name, load_run(metrics_file, plan_file, skip_iterations=2)))
        print(f"{name:22s} memory predicted {pred_mem / 2**20:8.1f} MiB measured "
              f"{measured_mem / 2**20:8.1f} MiB ({_err(pred_mem, measured_mem)}) | time "
              f"predicted {pred_time * 1e3:8.1f} ms measured {measured_time * 1e3:8.1f} ms "
              f"({_err(pred_time, measured_time)}) | load {load}", flush=True)
        # The run's own per-stage breakdown against the estimate (--timing-log-level 1): which
        # term the model got wrong. The first comparison is of the second iteration.
        for line in _stage_comparison(proc.stdout + proc.stderr):
            print(f"    {line}", flush=True)

    if rows:
        mem_err = [abs(p / m - 1) for _, p, m, _, _, _ in rows if m]
        under = [1 - p / m for _, p, m, _, _, _ in rows if m and p < m]
        time_err = [abs(p / m - 1) for _, _, _, p, m, _ in rows if m]
        print(f"\nmemory: max |error| {max(mem_err, default=0) * 100:.1f}% (target 10%), worst "
              f"under-estimate {max(under, default=0) * 100:.1f}% (target 5%)")
        print(f"time:   max |error| {max(time_err, default=0) * 100:.1f}%, median "
              f"{statistics.median(time_err) * 100:.1f}% (target 25%)")
    if len(runs) >= 3:
        leave_one_out(runs, cluster, profile, spec, training)
    if args.table_out and rows:
        Path(args.table_out).write_text(markdown_table(rows, args.nproc, args.iters,
                                                       profile_load))
    return 0


def markdown_table(rows, nproc: int, iters: int | None, profile_load: str) -> str:
    """The per-plan results as a Markdown table, with the summary line under it. ``rows``:
    ``(plan, predicted memory, measured memory, predicted time, measured time, load)``."""
    how = f"--nproc {nproc} --iters {iters}" if iters else "--reprice DIR"
    out = [f"`python benchmarks/validate_cost_model.py {how}` ({nproc} CPU ranks, gloo, fp32; "
           f"load average {profile_load} while profiling):",
           "",
           "| plan | memory predicted MiB | measured MiB | error | time predicted ms | "
           "measured ms | error | load (1, 5, 15 min) |", "|---|---|---|---|---|---|---|---|"]
    for name, pm, mm, pt, mt, load in rows:
        out.append(f"| {name} | {pm / 2**20:.1f} | {mm / 2**20:.1f} | {_err(pm, mm)} | "
                   f"{pt * 1e3:.1f} | {mt * 1e3:.1f} | {_err(pt, mt)} | {load} |")
    time_err = [abs(p / m - 1) for _, _, _, p, m, _ in rows if m]
    mem_err = [abs(p / m - 1) for _, p, m, _, _, _ in rows if m]
    under = [1 - p / m for _, p, m, _, _, _ in rows if m and p < m]
    out += ["", f"Time: max |error| {max(time_err) * 100:.1f}%, median "
                f"{statistics.median(time_err) * 100:.1f}%; memory: max |error| "
                f"{max(mem_err) * 100:.1f}%, worst under-estimate "
                f"{max(under, default=0) * 100:.1f}%.", ""]
    return "\n".join(out)


def reprice(work: Path, table_out: str | None) -> int:
    """Price every plan of a finished run's work dir again with the current cost model,
    against the iteration times and peaks that run measured (same rules as a fresh run)."""
    from megatron_auto.planner.inputs.profiles import (ModelProfile,  # noqa: PLC0415
                                                       with_analytic_layer_types)

    cluster = ClusterSpec.load(work / "cluster.json")
    profiles = sorted((work / "cache").glob("*.json"))
    if not cluster or not profiles:
        print(f"--reprice {work}: no cluster.json or cache/*.json (a validate_cost_model work dir?)")
        return 2
    # The --auto-parallel run's profile: the one with the TP shards timed (a run made before
    # auto_parallel_profile also holds a second one, measured alone by the script itself).
    # (an MoE model's profile records its router's load imbalance; the dense one's none)
    loaded = [ModelProfile.load(f) for f in profiles]
    by_model = {}
    for model in (MODEL, MOE_MODEL):
        mine = [p for p in loaded
                if (p.layer_types["gpt"].moe_load_imbalance > 0) == (model.moe is not None)]
        if mine:
            by_model[id(model)] = max(mine, key=lambda p: len(p.layer_types["gpt"].forward_time_by_tp))
    training = TrainingSpec(global_batch_size=GLOBAL_BATCH, precision="fp32")
    rows = []
    order = list(plans(cluster.world_size))
    for metrics_file in sorted(work.glob("*.jsonl"), key=lambda f: (
            order.index(f.stem) if f.stem in order else len(order), f.stem)):
        plan = Plan.load(work / f"{metrics_file.stem}.json")
        records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        later = records[2:] or records
        measured_time = statistics.median(r["iteration_time_s"] for r in later)
        measured_mem = max((r.get("peak_memory_bytes") or 0) for r in records)
        model = model_of(metrics_file.stem)
        spec = model_spec(model)
        profile = with_analytic_layer_types(by_model[id(model)], spec, training, cluster)
        est = evaluate(plan, spec, training, cluster, profile)
        pred_mem = max(s.peak_memory_bytes for s in est.stages)
        load_file = work / f"{metrics_file.stem}.load"
        load = load_file.read_text() if load_file.exists() else "not recorded"
        rows.append((metrics_file.stem, pred_mem, measured_mem, est.iteration_time_s,
                     measured_time, load))
        print(f"{metrics_file.stem:22s} memory {_err(pred_mem, measured_mem):>7s} | time "
              f"predicted {est.iteration_time_s * 1e3:8.1f} ms measured "
              f"{measured_time * 1e3:8.1f} ms ({_err(est.iteration_time_s, measured_time)})")
    if table_out and rows:
        load_file = work / "profile.load"
        Path(table_out).write_text(markdown_table(
            rows, cluster.world_size, None,
            load_file.read_text() if load_file.exists() else "not recorded"))
    return 0


def leave_one_out(runs, cluster, profile, spec, training) -> None:
    """Calibrate (megatron-auto calibrate's fit) on all runs but one, predict the one left out:
    the out-of-sample error a calibrated planner would have on a new plan."""
    print("\nleave-one-out calibration (fit on the other plans, predict this one):")
    mem_err, time_err = [], []
    for i, (name, run) in enumerate(runs):
        others = [r for j, (_, r) in enumerate(runs) if j != i]
        cal = fit_calibration(others, cluster, profile, spec_of=spec_of_record)
        c2, p2 = apply_calibration(cal, cluster, profile)
        est = evaluate(run.plan, spec, training, c2, p2)
        pred_mem = max(s.peak_memory_bytes for s in est.stages)
        mem_err.append(pred_mem / run.peak_memory_bytes - 1)
        time_err.append(est.iteration_time_s / run.iteration_time_s - 1)
        print(f"{name:22s} memory {_err(pred_mem, run.peak_memory_bytes):>7s} | time "
              f"{_err(est.iteration_time_s, run.iteration_time_s):>7s}")
    print(f"calibrated memory: max |error| {max(map(abs, mem_err)) * 100:.1f}%, worst "
          f"under-estimate {max([0.0] + [-e for e in mem_err]) * 100:.1f}%; time: max |error| "
          f"{max(map(abs, time_err)) * 100:.1f}%, median "
          f"{statistics.median(map(abs, time_err)) * 100:.1f}%")


def _stage_comparison(log: str) -> list[str]:
    """The per-stage "predicted vs measured" lines a run printed (training/timing_report.py)."""
    return [line.split(">", 1)[1].strip() for line in log.splitlines()
            if line.lstrip().startswith(">") and "predicted vs measured" in line]


def _load() -> str:
    """The 1-, 5- and 15-minute load averages (on a shared machine, the noise to read a row
    with: the profiles were measured at one load, each plan trains at another)."""
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _err(pred: float, measured: float) -> str:
    if not measured:
        return "not measured"
    return f"{(pred / measured - 1) * 100:+.1f}%"


if __name__ == "__main__":
    raise SystemExit(main())
