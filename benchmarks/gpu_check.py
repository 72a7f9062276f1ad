"""The prepared GPU check: one script, under 5 minutes on one GPU, that measures what the CPU
tests cannot (issue 16 item 5) and writes a JSON report after each part.

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_check.json
    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run --out /tmp/dry.json   # CPU, tiny

It uses the machine's own Python and PyTorch, installs nothing and needs no network;
Transformer Engine and apex are used when they import and reported absent otherwise.

- (a) GPT-1.3B (24 layers, hidden 2048, 16 heads, seq 2048) in bf16 on one GPU: tokens/s and
  MFU of our runtime (``train_step``) against a plain-PyTorch model of the same math
  (benchmarks/bench_gpt_step.py's ``PlainGPT`` from our initial weights, under the same autocast
  and fused AdamW), interleaved step by step; target MFU >= 50% on H100/H200-class GPUs.
- (b) the model profiler (one GPT-1.3B layer: times, activation bytes, the SDPA kernel that ran)
  and the hardware profiler (matmul FLOP/s, HBM copy bandwidth, overlap, optimizer step, NCCL
  communicator bytes on more than one GPU).
- (c) >= 6 single-GPU plans of a 12-layer model with the same layer (recompute on/off, 1-4
  micro-batches, Transformer Engine when it imports): predicted (cost model with the measured
  profiles of (b), and the analytic profile on the matching preset) against measured iteration
  time and device peak memory (reserved + outside the allocator); targets: memory error <= 5%,
  time error <= 10%.
- (d) with 2 or more GPUs, 4 multi-GPU plans (data parallel, tensor parallel, pp=2 1F1B and a
  ZeRO-3/ZeRO-2/DDP layer mix) run under torchrun by this script's ``--worker`` mode, which
  first profiles the hardware of that world.

``--dry-run`` runs every part's code on CPU with tiny shapes and gloo (part (d) on 2 CPU ranks):
it is what CI runs (tests/test_gpu_check.py). The script prints what it measured and asserts
nothing; ``status`` per part is ``ok``, ``skipped (reason)`` or ``error: ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_auto.config import ModelConfig  # noqa: E402
from megatron_auto.utils.jsonfile import write_json  # noqa: E402
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy  # noqa: E402
from megatron_auto.planner.inputs.hardware import ClusterSpec  # noqa: E402
from megatron_auto.planner.inputs.model_spec import TrainingSpec  # noqa: E402
from megatron_auto.families.registry import model_spec  # noqa: E402
from megatron_auto.planner.inputs.presets import make_cluster  # noqa: E402
from megatron_auto.planner.inputs.profiles import ModelProfile, analytic_profile  # noqa: E402
from megatron_auto.planner.search.driver import evaluate  # noqa: E402
from bench_setup import gpt_batch  # noqa: E402 - next to this script

GPT_1_3B = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                       vocab_size=50257, hidden_dropout=0.0, attention_dropout=0.0)
TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16,
                   vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Shapes and repetitions of one run: the real one or the dry run."""

    dry: bool
    big: ModelConfig  # part (a)
    layers_c: int  # part (c)'s model: the same layer, fewer of them
    batch: int  # global batch of (a) and (c)
    steps: int
    warmup: int
    precision: str  # bf16 on GPUs; fp32 in the dry run (CPU bf16 kernels are slow)

    @property
    def model_c(self) -> ModelConfig:
        return dataclasses.replace(self.big, num_layers=self.layers_c)

    def model_d(self, world: int) -> ModelConfig:
        return dataclasses.replace(self.big, num_layers=2 if self.dry else 8)


def setup_for(dry: bool) -> Setup:
    if dry:
        return Setup(True, TINY, layers_c=2, batch=4, steps=1, warmup=0, precision="fp32")
    return Setup(False, GPT_1_3B, layers_c=12, batch=4, steps=5, warmup=2, precision="bf16")


# ---------------------------------------------------------------------------------- helpers
def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_rank_world(device: torch.device) -> None:
    if dist.is_initialized():
        return
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1"})
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _free_port() -> int:
    import socket  # noqa: PLC0415 - only for the port

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def plan_of(world: int, cfg: ModelConfig, batch: int, m: int, *, tp: int = 1, pp: int = 1,
            recompute: Callable[[int], bool] = lambda i: False,
            dp_mode: Callable[[int], str] = lambda i: "ddp") -> Plan:
    n = cfg.num_layers
    return Plan(world_size=world, global_batch_size=batch, num_microbatches=m,
                pipeline=PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=(n // pp,) * pp),
                vocab=VocabStrategy(tp=tp), layers=tuple(
                    LayerStrategy(tp=tp, dp_mode=dp_mode(i), recompute=recompute(i))
                    for i in range(n)))


def build(cfg: ModelConfig, plan: Plan, device: torch.device, precision: str) -> Any:
    from megatron_auto.models.gpt import GPTStage  # noqa: PLC0415
    from megatron_auto.training.precision import PrecisionConfig  # noqa: PLC0415
    from megatron_auto.training.trainer import build_trainer  # noqa: PLC0415

    return build_trainer(cfg, plan, lambda c, ctx, seed: GPTStage(c, ctx, seed=seed),
                         precision=PrecisionConfig(bf16=precision == "bf16"), device=device)


def measure(trainer: Any, cfg: ModelConfig, setup: Setup, device: torch.device) -> dict:
    """Median iteration seconds after warm-up, then one metered iteration's device peak."""
    from megatron_auto.parallel.memory import PeakMemoryMeter  # noqa: PLC0415
    from megatron_auto.training.trainer import train_step  # noqa: PLC0415

    reads = trainer.reads_data
    times = []
    for step in range(setup.warmup + setup.steps):
        batch = gpt_batch(cfg, trainer.plan.global_batch_size, step) if reads else None
        _sync(device)
        start = time.perf_counter()
        train_step(trainer, batch)
        _sync(device)
        if step >= setup.warmup:
            times.append(time.perf_counter() - start)
    meter = PeakMemoryMeter(device, trainer.stage, trainer.optimizer)
    meter.start()
    train_step(trainer, gpt_batch(cfg, trainer.plan.global_batch_size, 99) if reads else None)
    meter.stop()
    peak = meter.device_peak_bytes
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([float(peak), max(times)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak = int(t[0].item())
    # the breakdown on CUDA: allocator cache (fragmentation: the cost model's
    # fragmentation_fraction is this over activations and transients) and context + NCCL
    return {"iteration_time_s": statistics.median(times), "peak_memory_bytes": int(peak),
            "allocated_peak_bytes": int(meter.peak_bytes),
            "breakdown": {k: int(v) for k, v in (meter.breakdown or {}).items()}}


def _error(part: dict, err: BaseException) -> None:
    part["status"] = f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    part["traceback"] = traceback.format_exc()[-4000:]


def _preset_for(device: torch.device) -> ClusterSpec | None:
    """The preset of this GPU (by name), one node of one device, or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, gpu in (("H200", "h200-141g"), ("H100", "h100-80g"), ("A100", "a100-80g")):
        if fragment in name:
            if gpu == "a100-80g" and torch.cuda.get_device_properties(device).total_memory < 60e9:
                gpu = "a100-40g"
            return make_cluster(gpu, 1, 1)
    return None


def _err(pred: float, meas: float) -> float | None:
    return pred / meas - 1.0 if meas else None


# ------------------------------------------------------------------------------------- parts
def part_a(setup: Setup, device: torch.device) -> dict:
    """Tokens/s and MFU of our runtime against plain PyTorch (same math, same autocast)."""
    from bench_gpt_step import plain_like  # noqa: PLC0415 - the shared baseline model

    from megatron_auto.parallel.optimizer import OptimizerConfig, build_optimizer  # noqa: PLC0415
    from megatron_auto.training.metrics import device_peak_tflops, model_flops_per_token  # noqa: PLC0415
    from megatron_auto.training.trainer import train_step  # noqa: PLC0415

    cfg = setup.big
    plan = plan_of(1, cfg, setup.batch, 1)
    ours = build(cfg, plan, device, setup.precision)
    plain = plain_like(ours.stage, cfg).to(device)  # our initial weights: same softmax range
    opt = build_optimizer(plain.parameters(), OptimizerConfig(), lr=1e-4,
                          named_parameters=plain.named_parameters())
    amp = torch.bfloat16 if setup.precision == "bf16" else None

    def plain_step(batch: dict) -> None:
        opt.zero_grad(set_to_none=True)
        b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = plain(**b) / b["loss_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, foreach=True)
        opt.step()

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for step in range(setup.warmup + setup.steps):
        batch = gpt_batch(cfg, setup.batch, step)
        for name, fn in (("ours", lambda b: train_step(ours, b)), ("plain", plain_step)):
            _sync(device)
            start = time.perf_counter()
            fn(batch)
            _sync(device)
            if step >= setup.warmup:
                times[name].append(time.perf_counter() - start)
    tokens = setup.batch * cfg.seq_length
    flops = model_flops_per_token(cfg) * tokens
    peak = device_peak_tflops(device, setup.precision == "bf16")
    out: dict[str, Any] = {"model": cfg.to_dict(), "global_batch": setup.batch,
                           "peak_tflops": peak}
    for name, series in times.items():
        s = statistics.median(series)
        out[name] = {"step_s": s, "tokens_per_s": tokens / s, "tflops": flops / s / 1e12,
                     "mfu": flops / s / 1e12 / peak if peak else None}
    out["speed_ratio_plain_over_ours"] = out["plain"]["step_s"] / out["ours"]["step_s"]
    out["target"] = "MFU >= 0.50 on one H100/H200-class GPU (ours)"
    del ours, plain, opt
    return out


def part_b(setup: Setup, device: torch.device, work: Path) -> tuple[dict, ModelProfile, ClusterSpec]:
    """The model profiler on the layer of (a)/(c), the hardware profiler on this device."""
    from megatron_auto.profiler.hardware_profiler import (HardwareProfilerConfig,  # noqa: PLC0415
                                                          profile_hardware)
    from megatron_auto.profiler.lookup import get_or_create_model_profile  # noqa: PLC0415
    from megatron_auto.profiler.measure import ModelProfilerConfig  # noqa: PLC0415

    mp_config = ModelProfilerConfig(batch_sizes=(1, 2) if setup.dry else (),
                                    warmup_iters=0 if setup.dry else 1,
                                    iters=1 if setup.dry else 3)
    start = time.perf_counter()
    profile = get_or_create_model_profile(setup.big, setup.precision, device,
                                          cache_dir=str(work / "cache"),
                                          config=mp_config, force=True)
    model_s = time.perf_counter() - start
    hw_config = HardwareProfilerConfig(message_sizes=(2**12, 2**14) if setup.dry else (),
                                       iters=2 if setup.dry else 5,
                                       matmul_size=64 if setup.dry else 0, matmul_iters=2,
                                       overlap_comm_iters=1 if setup.dry else 4,
                                       overlap_repeats=1 if setup.dry else 3)
    start = time.perf_counter()
    cluster = profile_hardware(hw_config).to_cluster_spec()
    hw_s = time.perf_counter() - start
    profile.save(work / "model_profile.json")
    cluster.save(work / "cluster.json")
    layer = next(iter(profile.layer_types.values()))
    return ({"model_profile_s": model_s, "hardware_profile_s": hw_s,
             "layer": {"forward_per_sample_s": layer.forward_time_per_sample_s,
                       "forward_constant_s": layer.forward_time_constant_s,
                       "backward_forward_ratio": layer.backward_forward_ratio,
                       "activation_bytes_per_sample": layer.activation_bytes(1),
                       "attention_backend": layer.attention_backend},
             "cluster": {k: v for k, v in cluster.to_dict().items()
                         if k not in ("allreduce_busbw_table", "p2p_bw_table", "source")}},
            profile, cluster)


def single_gpu_plans(setup: Setup, te: bool) -> dict[str, tuple[ModelConfig, Plan]]:
    cfg = setup.model_c
    b = setup.batch
    half = lambda i: i % 2 == 0  # noqa: E731
    plans = {
        "m1": (cfg, plan_of(1, cfg, b, 1)),
        "m2": (cfg, plan_of(1, cfg, b, 2)),
        "m4": (cfg, plan_of(1, cfg, b, 4)),
        "recompute-m1": (cfg, plan_of(1, cfg, b, 1, recompute=lambda i: True)),
        "recompute-half-m2": (cfg, plan_of(1, cfg, b, 2, recompute=half)),
        "batch2x-recompute-m2": (cfg, plan_of(1, cfg, 2 * b, 2, recompute=lambda i: True)),
    }
    if te:
        te_cfg = dataclasses.replace(cfg, transformer_impl="transformer_engine")
        plans["te-m1"] = (te_cfg, plan_of(1, te_cfg, b, 1))
        plans["te-recompute-m2"] = (te_cfg, plan_of(1, te_cfg, b, 2, recompute=lambda i: True))
    return plans


def predictions(cfg: ModelConfig, plan: Plan, cluster: ClusterSpec, profile: ModelProfile,
                preset: ClusterSpec | None) -> dict:
    spec = model_spec(cfg)
    training = TrainingSpec(global_batch_size=plan.global_batch_size, precision=profile.precision)
    out = {}
    est = evaluate(plan, spec, training, cluster, profile)
    out["measured_profiles"] = {"iteration_time_s": est.iteration_time_s,
                                "peak_memory_bytes": est.peak_memory_bytes}
    if preset is not None:
        est = evaluate(plan, spec, training, preset, analytic_profile(spec, training, preset))
        out["analytic_preset"] = {"iteration_time_s": est.iteration_time_s,
                                  "peak_memory_bytes": est.peak_memory_bytes,
                                  "preset": preset.name}
    return out


def _compare(row: dict) -> None:
    meas = row["measured"]
    for pred in row["predicted"].values():
        pred["time_error"] = _err(pred["iteration_time_s"], meas["iteration_time_s"])
        pred["memory_error"] = _err(pred["peak_memory_bytes"], meas["peak_memory_bytes"])


def part_c(setup: Setup, device: torch.device, cluster: ClusterSpec, profile: ModelProfile,
           report: dict, save: Callable[[], None]) -> dict:
    te = importlib.util.find_spec("transformer_engine") is not None and not setup.dry
    out: dict[str, Any] = {"plans": {}, "transformer_engine": te,
                           "targets": "memory error <= 5%, time error <= 10% per plan"}
    report["parts"]["c"] = out
    preset = _preset_for(device)
    for name, (cfg, plan) in single_gpu_plans(setup, te).items():
        row: dict[str, Any] = {"plan": plan.to_dict()}
        out["plans"][name] = row
        try:
            row["predicted"] = predictions(cfg, plan, cluster, profile, preset)
            trainer = build(cfg, plan, device, setup.precision)
            row["measured"] = measure(trainer, cfg, setup, device)
            del trainer
            _compare(row)
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - one plan's failure must not lose the others
            _error(row, err)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    return out


def multi_gpu_plans(world: int, cfg: ModelConfig, batch: int) -> dict[str, Plan]:
    n = cfg.num_layers
    mix = ("zero3", "zero2", "ddp", "zero3")
    return {
        f"dp{world}": plan_of(world, cfg, batch, 2),
        "tp2": plan_of(world, cfg, batch, 2, tp=2),
        "pp2-1f1b": plan_of(world, cfg, batch, 4, pp=2),
        "zero3-mix": plan_of(world, cfg, batch, 2, dp_mode=lambda i: mix[i % 4],
                             recompute=lambda i: i >= n // 2),
    }


def worker(args: argparse.Namespace) -> int:
    """One torchrun rank of part (d): profile this world's hardware, train each plan."""
    from megatron_auto.parallel.device import select_local_cuda_device  # noqa: PLC0415
    from megatron_auto.profiler.hardware_profiler import (HardwareProfilerConfig,  # noqa: PLC0415
                                                          profile_hardware)

    setup = setup_for(args.dry_run)
    select_local_cuda_device()
    device = _device()
    if device.type == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    hw = HardwareProfilerConfig(message_sizes=(2**12, 2**14) if setup.dry else (),
                                iters=2 if setup.dry else 5, matmul_size=64 if setup.dry else 0,
                                matmul_iters=2, overlap_comm_iters=1 if setup.dry else 4,
                                overlap_repeats=1 if setup.dry else 3)
    cluster = profile_hardware(hw).to_cluster_spec()
    results: dict[str, Any] = {"cluster": cluster.to_dict(), "plans": {}}
    cfg = setup.model_d(world)
    for name, plan in multi_gpu_plans(world, cfg, 2 * world * (1 if setup.dry else 2)).items():
        try:
            trainer = build(cfg, plan, device, setup.precision)
            results["plans"][name] = {"measured": measure(trainer, cfg, setup, device),
                                      "plan": plan.to_dict()}
            del trainer
        except Exception as err:  # noqa: BLE001 - report and go on to the next plan
            results["plans"][name] = {}
            _error(results["plans"][name], err)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        write_json(args.worker_out, results)
    dist.destroy_process_group()
    return 0


def part_d(setup: Setup, profile: ModelProfile, work: Path) -> dict:
    gpus = torch.cuda.device_count()
    world = 2 if setup.dry else min(gpus, 4)
    if not setup.dry and gpus < 2:
        return {"status": f"skipped (needs 2 or more GPUs, found {gpus})"}
    out_file = work / "multi.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(Path(__file__).resolve()), "--worker",
           "--worker-out", str(out_file)] + (["--dry-run"] if setup.dry else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode or not out_file.exists():
        return {"status": f"error: torchrun exited {proc.returncode}",
                "stderr": proc.stderr[-4000:], "stdout": proc.stdout[-2000:]}
    results = json.loads(out_file.read_text())
    cluster = ClusterSpec.from_dict(results["cluster"])
    cfg = setup.model_d(world)
    out: dict[str, Any] = {"world_size": world, "plans": {}}
    for name, row in results["plans"].items():
        if "measured" in row:
            try:
                row["predicted"] = predictions(cfg, Plan.from_dict(row["plan"]), cluster,
                                               profile, None)
                _compare(row)
                row["status"] = "ok"
            except Exception as err:  # noqa: BLE001
                _error(row, err)
        out["plans"][name] = row
    return out


def machine() -> dict:
    dev = _device()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda" else f"cpu-{platform.machine()}",
            "gpus": torch.cuda.device_count(),
            "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
            "apex": importlib.util.find_spec("apex") is not None}


def _summary(report: dict) -> str:
    lines = []
    a = report["parts"].get("a", {})
    if "ours" in a:
        lines.append(f"(a) ours {a['ours']['tokens_per_s']:,.0f} tokens/s MFU {a['ours']['mfu']}, "
                     f"plain {a['plain']['tokens_per_s']:,.0f} tokens/s; ratio plain/ours "
                     f"{a['speed_ratio_plain_over_ours']:.3f}")
    for key in ("c", "d"):
        for name, row in report["parts"].get(key, {}).get("plans", {}).items():
            pred = row.get("predicted", {}).get("measured_profiles")
            if pred and pred.get("time_error") is not None:
                lines.append(f"({key}) {name:22s} time {pred['time_error']:+.1%} memory "
                             f"{pred['memory_error']:+.1%}")
            else:
                lines.append(f"({key}) {name:22s} {row.get('status', '?')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (CI)")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report")
    parser.add_argument("--parts", default="abcd", help="which parts to run (default abcd)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    setup = setup_for(args.dry_run)
    if not setup.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry-run for the CPU code paths",
              file=sys.stderr)
        return 2
    device = _device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    report: dict[str, Any] = {"dry_run": setup.dry, "machine": machine(), "parts": {},
                              "work_dir": str(work)}

    def save() -> None:
        write_json(args.out, report)

    _one_rank_world(device)
    profile = cluster = None
    for key, fn in (("a", lambda: part_a(setup, device)), ("b", None), ("c", None),
                    ("d", None)):
        if key not in args.parts:
            continue
        start = time.perf_counter()
        try:
            if key == "a":
                report["parts"]["a"] = fn()
            elif key == "b":
                report["parts"]["b"], profile, cluster = part_b(setup, device, work)
            elif key == "c":
                if profile is None:
                    raise RuntimeError("part c needs part b's profiles (run --parts bc)")
                part_c(setup, device, cluster, profile, report, save)
            else:
                if profile is None:
                    raise RuntimeError("part d needs part b's model profile (run --parts bd)")
                report["parts"]["d"] = part_d(setup, profile, work)
            report["parts"][key].setdefault("status", "ok")
        except Exception as err:  # noqa: BLE001 - record it and go on with the next part
            report["parts"][key] = report["parts"].get(key, {})
            _error(report["parts"][key], err)
        report["parts"][key]["seconds"] = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
        print(f"gpu_check: part {key}: {report['parts'][key]['status']} "
              f"({report['parts'][key]['seconds']:.1f} s)", flush=True)
    print(_summary(report))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
