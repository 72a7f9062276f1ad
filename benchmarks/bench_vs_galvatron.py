"""Our planner against Galvatron 2.4's search, on the input files Galvatron ships.

    python benchmarks/bench_vs_galvatron.py                    # every case, throwaway venv
    python benchmarks/bench_vs_galvatron.py --only llama       # one model: bert, llama, gpt, vit
    python benchmarks/bench_vs_galvatron.py --galvatron-venv DIR   # reuse (or build once into) DIR
    python benchmarks/bench_vs_galvatron.py --galvatron-source hetu_galvatron-2.4.0.tar.gz
        # offline: Galvatron from a local sdist (or its unpacked directory), no package index
        # for it (also GALVATRON_SOURCE=...); --wheels DIR for numpy/scipy/tqdm/pybind11
    python benchmarks/bench_vs_galvatron.py --table-out table.md   # the docs/planner.md §8 table
    python benchmarks/bench_vs_galvatron.py --galvatron-spaces default   # one Galvatron space

What runs:

1. A virtual environment under a temporary directory (never in the repository) gets
   ``hetu-galvatron==2.4.0`` with ``--no-deps`` (its C++ dynamic-programming core is compiled on
   install), from the package index or, offline, from ``--galvatron-source`` (``pip install
   --no-index``), plus numpy, scipy, tqdm and pybind11 (from ``--wheels DIR`` with
   ``--no-index``, else the configured index). Its search modules import without torch or
   apex when the heavy package ``__init__`` files are bypassed, which the driver below does.
2. Per case, memory budget and Galvatron space, Galvatron's ``GalvatronSearchEngine`` searches
   (freshly, every run: nothing of Galvatron's is stored or reused) in its own
   process on its shipped profiles of the model (``models/<model>/configs``) and hardware
   (``profile_hardware/hardware_configs``), batch size fixed (``--settle_bsz``). Where 2.4's
   own reader cannot read a file it ships in an older layout (LLaMA's and GPT's flat memory
   records, GPT's one-value time record, no ``sp_time`` file for 2 nodes), the values are
   re-keyed into the layout 2.4 reads (same numbers); see ``_stage_for_galvatron``. Its two
   spaces (``GALVATRON_SPACES``): its default, vocab TP searched and TP placement consecutive
   and non-consecutive, and the smaller one with ``--disable_vtp 1 --disable_tp_consec 1``.
3. Ours, on the *unmodified* shipped files: ``megatron-auto import-galvatron`` (profile and
   cluster) then ``megatron-auto plan``, each a whole command in its own process, run again
   next to each Galvatron search, twice: in our full space (a superset of both Galvatron
   spaces: ZeRO-1, DDP, per-layer Megatron-SP, interleaving besides), and in Galvatron's
   (``--search-space galvatron``, with ``--vocab-tensor-parallel-size 1
   --tp-consecutive-only`` for its smaller one and ``--sequence-parallel`` where Galvatron
   gets ``--sequence_parallel``: ``OUR_SAME_SPACE``). That space still holds every plan of
   Galvatron's and a few more (the vocabulary's tp is not tied to the least layer tp, the
   partitions are all searched, pp may reach 16), so the same-space ratio does not favour us.
4. Every plan is priced by our evaluator (``megatron-auto evaluate --json``) with the same
   imported profile, cluster and budget.

Printed per case and space: Galvatron's time (whole process, and its search alone), ours
(import + plan, whole commands) in each of our two spaces, the ratio of wall times and of CPU
times (the children's user + system seconds: on a shared machine the wall ratio moves with the
load, the CPU ratio much less), the plans' throughput under our cost model, our certified gaps
(``plan.search["optimality_gap"]``) and the load average before Galvatron's search and after
ours; then the totals per Galvatron space. Budgets are
Galvatron's GB (2**30 bytes); ours gets the same bytes. Galvatron silently keeps 20 % of any
budget over 20 GB for its allocator, so its plans at 24+ GB are searched in 80 % of the budget
(our evaluator prices them against the full budget). Timing is for a shared 2-core machine:
read the ratios, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_auto.planner.interop.galvatron_files import read_computation

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
GALVATRON = "hetu-galvatron==2.4.0"

# Galvatron's two spaces per case: its default (vocab TP searched, TP placement consecutive and
# non-consecutive) and the smaller one without both (``--disable_vtp 1`` pins the embedding and
# head to tp 1, ``--disable_tp_consec 1`` drops the non-consecutive TP layouts), and our flags
# for the same space (``--search-space galvatron``: the DP flavours of its --default_dp_type
# zero2 and SDP, no interleaving; module docstring, item 3).
GALVATRON_SPACES: dict[str, list[str]] = {
    "default": [],
    "no vtp, consec": ["--disable_vtp", "1", "--disable_tp_consec", "1"],
}
OUR_SAME_SPACE: dict[str, list[str]] = {
    "default": ["--search-space", "galvatron"],
    "no vtp, consec": ["--search-space", "galvatron", "--vocab-tensor-parallel-size", "1",
                       "--tp-consecutive-only"],
}

# The cases of issue 11 item 7: model directory in Galvatron's package, its file-name model
# tag, the layer configuration its engine takes, its time/memory profile modes for those files,
# our model flags, cluster shape, batch and budgets (GB = 2**30 bytes).
CASES: dict[str, dict[str, Any]] = {
    "bert": {
        "label": "BERT-Large, 8 GPUs, batch 128", "dir": "bert_hf", "tag": "hidden1024_head16",
        "layers": [{"hidden_size": 1024, "layer_num": 24, "seq_len": 512}],
        "time_mode": "sequence", "sequence_parallel": True, "model_type": "bert", "nodes": 1,
        "gpus": 8, "batch": 128,
        "budgets": [8, 12, 16, 20],
        "flags": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
                  "--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size",
                  "30522", "--model-type", "bert"]},
    "llama": {
        "label": "LLaMA-7B, 8 GPUs, batch 64", "dir": "llama_hf",
        "tag": "hidden4096_head32_seqlen2048",
        "layers": [{"hidden_size": 4096, "layer_num": 32, "seq_len": 2048}],
        "time_mode": "batch", "sequence_parallel": False, "nodes": 1, "gpus": 8, "batch": 64,
        "budgets": [24, 36, 48],
        "flags": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                  "--ffn-hidden-size", "11008", "--seq-length", "2048",
                  "--max-position-embeddings", "2048", "--vocab-size", "32000", "--swiglu",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                  "--untie-embeddings-and-output-weights"]},
    "gpt": {
        "label": "GPT-1.5B, 2x8 GPUs, batch 128", "dir": "gpt_hf",
        "tag": "hidden1600_head32_seqlen1024",
        "layers": [{"hidden_size": 1600, "layer_num": 48, "seq_len": 1024}],
        "time_mode": "static", "sequence_parallel": False, "nodes": 2, "gpus": 8, "batch": 128,
        "budgets": [20, 40],
        "flags": ["--num-layers", "48", "--hidden-size", "1600", "--num-attention-heads", "32",
                  "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size",
                  "50257"]},
    # Galvatron's smaller space only: in its default one (vocabulary TP on) 2.4's engine raises
    # KeyError on a 4-GPU cluster, iterating vocab tp 4 for pipelines whose stages have 2 GPUs
    # (dynamic_programming._build_dp_and_run_multi_layer_type).
    "vit": {
        "label": "ViT-Huge/16, 4 GPUs, batch 64", "dir": "vit_hf", "tag": "hidden1280_head16",
        "galvatron_spaces": ["no vtp, consec"],
        "layers": [{"hidden_size": 1280, "layer_num": 32, "seq_len": 197}],
        "time_mode": "static", "sequence_parallel": False, "model_type": "vit", "nodes": 1,
        "gpus": 4, "batch": 64,
        "budgets": [16],
        "flags": ["--model-type", "vit", "--num-layers", "32", "--hidden-size", "1280",
                  "--num-attention-heads", "16", "--img-h", "224", "--img-w", "224",
                  "--patch-dim", "16", "--num-classes", "1000"]},
}

# Runs in Galvatron's venv: import its search engine without the package __init__ files
# (they import torch, apex and the runtime), search once, print what it wrote and how long.
_DRIVER = r"""
import argparse, importlib.util, json, os, sys, time, types
t_start = time.perf_counter()
case = json.load(open(sys.argv[1]))
root = importlib.util.find_spec("galvatron").submodule_search_locations[0]
for name, sub in (("galvatron", ""), ("galvatron.utils", "utils"), ("galvatron.core", "core")):
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(root, sub)]
    sys.modules[name] = module
from galvatron.utils import config_utils, strategy_utils
for mod in (strategy_utils, config_utils):
    vars(sys.modules["galvatron.utils"]).update(
        {k: v for k, v in vars(mod).items() if not k.startswith("__")})
from galvatron.core.search_engine.arguments import galvatron_search_args
from galvatron.core.search_engine.search_engine import GalvatronSearchEngine
args = galvatron_search_args(argparse.ArgumentParser()).parse_args(case["argv"])
vars(args).update(case["model_args"])  # what its per-model argument parsers would add
engine = GalvatronSearchEngine(args)
engine.set_search_engine_info(case["path"], case["layers"], case["tag"])
engine.set_model_type(case.get("model_type", "gpt"))
t0 = time.perf_counter()
engine.initialize_search_engine()
engine.parallelism_optimization()
t1 = time.perf_counter()
out = [f for f in os.listdir(args.output_config_path) if f.startswith("galvatron_config_")]
print("GALVATRON_RESULT " + json.dumps({"search_s": t1 - t0, "process_s": t1 - t_start,
      "config": os.path.join(args.output_config_path, out[0]) if out else None}))
"""


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def make_venv(path: Path, source: Path | None = None, wheels: Path | None = None) -> Path:
    """A venv at ``path`` with Galvatron 2.4 (no deps) and what its search needs; reused when
    it already has Galvatron. ``source``: a local sdist or unpacked directory of
    ``hetu-galvatron`` 2.4.0, installed without any package index (offline); ``wheels``: a
    directory of wheels for the dependencies (``--no-index --find-links``)."""
    python = path / "bin" / "python"
    probe = [str(python), "-c", "import importlib.util,sys; "
             "sys.exit(importlib.util.find_spec('galvatron_dp_core') is None)"]
    if python.exists() and subprocess.run(probe).returncode == 0:
        return python
    if source is not None and not source.exists():
        sys.exit(f"--galvatron-source {source}: no such file or directory; give the "
                 f"hetu_galvatron-2.4.0 sdist (.tar.gz) or its unpacked directory")
    what = str(source) if source is not None else GALVATRON
    print(f"building a venv with {what} in {path} (a minute or two) ...", flush=True)
    _run([sys.executable, "-m", "venv", str(path)])
    index = ["--no-index", "--find-links", str(wheels)] if wheels is not None else []
    _run([str(python), "-m", "pip", "install", "-q", *index, "numpy", "scipy", "tqdm",
          "pybind11", "setuptools", "wheel"])
    target = [str(source)] if source is not None else [GALVATRON]
    offline = ["--no-index"] if source is not None else []
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
          *offline, *target])
    return python


def galvatron_root(python: Path) -> Path:
    out = _run([str(python), "-c", "import importlib.util; print(importlib.util.find_spec("
                "'galvatron').submodule_search_locations[0])"])
    return Path(out.stdout.strip())


def shipped_files(root: Path, case: dict[str, Any]) -> dict[str, Path]:
    """The files Galvatron ships for this case."""
    cfg = root / "models" / case["dir"] / "configs"
    hw = root / "profile_hardware" / "hardware_configs"
    shape = f"{case['nodes']}nodes_{case['gpus']}gpus_per_node"
    return {"computation": cfg / f"computation_profiling_bf16_{case['tag']}.json",
            "memory": cfg / f"memory_profiling_bf16_{case['tag']}.json",
            "allreduce": hw / f"allreduce_bandwidth_{shape}.json",
            "p2p": hw / f"p2p_bandwidth_{shape}.json", "overlap": hw / "overlap_coefficient.json",
            "sp_time": hw / f"sp_time_{shape}.json",
            "sp_time_1x8": hw / "sp_time_1nodes_8gpus_per_node.json"}


def _stage_for_galvatron(case: dict[str, Any], files: dict[str, Path], dest: Path) -> dict[str, str]:
    """Copies of the shipped files under the names 2.4's engine opens, re-keyed where 2.4's own
    reader needs its newer layout (the numbers are unchanged):

    - memory records flat (older layout) -> nested under the model's sequence length;
    - batch-mode time keys without a length (``layertype_0_bsz4``) -> with it (``..._seq2048``);
    - the one-value time record ``layertype_0`` -> ``layertype_0_bsz<b>_seq<s>``, and the
      embedding/head time derived from the raw totals as Galvatron's post-processing does
      (``layertype_other_bsz<b>_seq<s>``);
    - embedding/head records with one number (vocab tp 1 only) -> one per vocab tp 1..8, the
      tp 1 value halved per doubling (2.4 prices every vocab tp up to ``--max_tp_deg`` and
      fails without them; halving is how its own profiler fills missing degrees);
    - no ``sp_time`` file for this cluster shape (2.4 opens it even when it does not use it):
      the 1x8 one, unused with ``--sp_space tp``.
    """
    seq = case["layers"][0]["seq_len"]
    cfg, hw = dest / "configs", dest / "hardware"
    cfg.mkdir(parents=True, exist_ok=True)
    hw.mkdir(exist_ok=True)
    comp = json.loads(files["computation"].read_text())
    lifted: dict[str, Any] = {}
    for key, value in comp.items():
        if key.startswith("layertype_") and "_bsz" in key and "_seq" not in key:
            key = f"{key}_seq{seq}"
        lifted[key] = value
    if "layertype_0" in comp and not any(k.startswith("layertype_0_") for k in comp):
        ours = read_computation(files["computation"])
        (bsz, _), other_ms = next(iter(ours.other.items()))
        lifted[f"layertype_0_bsz{bsz}_seq{seq}"] = comp["layertype_0"]
        lifted[f"layertype_other_bsz{bsz}_seq{seq}"] = other_ms
    (cfg / files["computation"].name).write_text(json.dumps(lifted, indent=1))
    mem = json.loads(files["memory"].read_text())
    for key, value in mem.items():
        if key.startswith("other_memory_") and "model_states" in value:
            value = {part: v if isinstance(v, dict) else {str(k): v / k for k in (1, 2, 4, 8)}
                     for part, v in value.items()}
        if (key.startswith("layertype_") and "parameter_size" in value) or \
                (key.startswith("other_memory_") and "model_states" in value):
            mem[key] = {str(seq): value}
    (cfg / files["memory"].name).write_text(json.dumps(mem, indent=1))
    for kind in ("allreduce", "p2p", "overlap"):
        shutil.copy(files[kind], hw / files[kind].name)
    sp = files["sp_time"] if files["sp_time"].exists() else files["sp_time_1x8"]
    shutil.copy(sp, hw / files["sp_time"].name)
    return {"configs": str(cfg), "hardware": str(hw)}


def run_galvatron(python: Path, case: dict[str, Any], staged: dict[str, str], budget: int,
                  work: Path, keep: Path | None, timeout: float | None,
                  space: str = "default") -> dict[str, Any]:
    """Galvatron's search in its own process; with ``keep``, its result (times and plan) is
    stored there and a stored one is reused (its time does not depend on our code). Stopped
    after ``timeout`` seconds, its time is only a lower bound (``timed_out``)."""
    tag = "" if space == "default" else "_" + "".join(c for c in space if c.isalnum())
    record = keep / f"{case['dir']}_{budget}GB{tag}.json" if keep else None
    if record is not None and record.exists():
        return {**json.loads(record.read_text()), "reused": True}
    out = work / f"galvatron_out_{budget}{tag}"
    out.mkdir()
    argv = ["--num_nodes", str(case["nodes"]), "--num_gpus_per_node", str(case["gpus"]),
            "--memory_constraint", str(budget), "--settle_bsz", str(case["batch"]),
            "--mixed_precision", "bf16", "--pipeline_type", "pipedream_flush",
            "--default_dp_type", "zero2", "--search_space", "full", "--sp_space", "tp",
            "--time_profile_mode", case["time_mode"], "--memory_profile_mode", "static",
            "--memory_profiling_path", staged["configs"], "--time_profiling_path",
            staged["configs"], "--allreduce_bandwidth_config_path", staged["hardware"],
            "--p2p_bandwidth_config_path", staged["hardware"], "--overlap_coe_path",
            staged["hardware"], "--sp_time_path", staged["hardware"], "--output_config_path",
            str(out), "--log_dir", str(work / "galvatron_logs"), *GALVATRON_SPACES[space]]
    if case["sequence_parallel"]:
        argv.append("--sequence_parallel")
    spec = work / f"case_{budget}{tag}.json"
    spec.write_text(json.dumps({"argv": argv, "path": str(work), "layers": case["layers"],
                                "tag": case["tag"], "model_type": case.get("model_type", "gpt"),
                                "model_args": {"hidden_size": case["layers"][0]["hidden_size"],
                                               "seq_length": case["layers"][0]["seq_len"]}}))
    t0 = time.perf_counter()
    c0 = _children_cpu()
    try:
        proc = _run([str(python), "-c", _DRIVER, str(spec)], cwd=work, env=_env(),
                    timeout=timeout)
    except subprocess.TimeoutExpired:
        result: dict[str, Any] = {"wall_s": time.perf_counter() - t0, "search_s": float("nan"),
                                  "config": None, "timed_out": True, "cpu_s": float("nan")}
    else:
        wall = time.perf_counter() - t0
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("GALVATRON_RESULT ")][-1]
        result = {"wall_s": wall, "cpu_s": _children_cpu() - c0,
                  **json.loads(line.split(" ", 1)[1])}
    if record is not None and keep is not None:
        if result["config"]:
            kept = keep / f"{case['dir']}_{budget}GB{tag}_{Path(result['config']).name}"
            shutil.copy(result["config"], kept)
            result["config"] = str(kept)
        record.write_text(json.dumps(result, indent=1))
    return result


def _ours(*args: str) -> list[str]:
    """One of our commands as a user runs it: ``python -m megatron_auto`` is the installed
    ``megatron-auto`` script's entry (``console.py``: one BLAS thread, no interpreter
    teardown after the plan is written), which ``-m megatron_auto.cli`` skips."""
    return [sys.executable, "-m", "megatron_auto", *args]


def import_ours(case: dict[str, Any], files: dict[str, Path],
                work: Path) -> tuple[float, float, Path, Path]:
    """``megatron-auto import-galvatron`` of the case's files: (wall s, CPU s, profile,
    cluster)."""
    profile, cluster = work / "profile.json", work / "cluster.json"
    cmd = _ours("import-galvatron", *case["flags"], "--bf16", "--computation",
                str(files["computation"]), "--memory", str(files["memory"]),
                "--model-profile-out", str(profile), "--allreduce", str(files["allreduce"]),
                "--p2p", str(files["p2p"]), "--overlap", str(files["overlap"]),
                "--cluster-out", str(cluster), "--cluster", f"a100-40g-{case['nodes']}x{case['gpus']}")
    if files["sp_time"].exists():
        cmd += ["--sp-time", str(files["sp_time"])]
    t0, c0 = time.perf_counter(), _children_cpu()
    _run(cmd, env=_env())
    return time.perf_counter() - t0, _children_cpu() - c0, profile, cluster


_PYCACHE: dict[str, str] = {}


def _env() -> dict[str, str]:
    """Our checkout first on the path; one BLAS thread for both searches (both are meant to
    run on one core; the machine is shared); bytecode cached as an installed package has it
    (a temporary ``PYTHONPYCACHEPREFIX``, even where ``PYTHONDONTWRITEBYTECODE`` is set:
    Galvatron's venv has its bytecode from pip)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    if "dir" in _PYCACHE:
        env["PYTHONPYCACHEPREFIX"] = _PYCACHE["dir"]
    return env


def _common(case: dict[str, Any], profile: Path, cluster: Path, budget: int) -> list[str]:
    return [*case["flags"], "--bf16", "--global-batch-size", str(case["batch"]),
            "--model-profile", str(profile), "--cluster", str(cluster),
            "--memory-budget-gb", f"{budget * GIB / 1e9:.6f}"]


def plan_ours(case: dict[str, Any], profile: Path, cluster: Path, budget: int,
              work: Path, space: str | None = None) -> tuple[float, float, dict[str, Any], Path]:
    """``megatron-auto plan`` as a whole command: its wall and CPU time, what the plan file
    records of its search (times, proven) and the plan; in our full space, or with ``space``
    in the flags of that Galvatron space (``OUR_SAME_SPACE``)."""
    flags = [] if space is None else list(OUR_SAME_SPACE[space])
    if space is not None and case["sequence_parallel"]:
        flags.append("--sequence-parallel")  # Galvatron's global --sequence_parallel
    tag = "" if space is None else "_" + "".join(c for c in space if c.isalnum())
    plan = work / f"plan_{budget}{tag}.json"
    t0, c0 = time.perf_counter(), _children_cpu()
    _run(_ours("plan", *_common(case, profile, cluster, budget), *flags, "--plan-out", str(plan),
               "--quiet"), env=_env())
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    search = json.loads(plan.read_text()).get("search", {})
    return wall, cpu, search, plan


def startup_ours() -> float:
    """Seconds to start Python and import the CLI as the console entry does (one BLAS
    thread, ``os._exit``): the floor of every command of ours."""
    t0 = time.perf_counter()
    _run([sys.executable, "-c", "import os; os.environ.setdefault('OPENBLAS_NUM_THREADS', '1'); "
          "import megatron_auto.cli; os._exit(0)"], env=_env())
    return time.perf_counter() - t0


def evaluate_ours(case: dict[str, Any], profile: Path, cluster: Path, budget: int,
                  source: list[str]) -> dict[str, Any]:
    proc = subprocess.run(_ours("evaluate", *_common(case, profile, cluster, budget), *source,
                                "--json"), capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout)


def _throughput(est: dict[str, Any]) -> str:
    if "error" in est:
        return f"none ({est['error'][:80]})"
    fits = "" if est.get("feasible", True) else " (over budget)"
    return f"{est['samples_per_s']:.2f}{fits}"


HEADER = ("| case | budget | Galvatron's space | Galvatron 2.4: process s (search s) | "
          "ours, full space: import + plan s (search CPU s) | ratio wall (CPU) | "
          "ours proven optimal | ours: certified gap | "
          "ours, Galvatron's space: import + plan s (search CPU s) | same-space ratio wall (CPU) "
          "| same space: certified gap | samples/s under our evaluator: Galvatron's plan / ours "
          "in its space / ours | load before-after |")


def _proven(info: dict[str, Any]) -> str:
    return "yes" if info.get("proven_optimal") else \
        f"no (limit {info.get('time_limit_s', '?')} s)" if info.get("time_limited") \
        else "no (gap reached)"


def _gap(info: dict[str, Any]) -> str:
    gap = info.get("optimality_gap")
    return "n/a" if gap is None else f"{gap:.2%}" + (" (limit)" if info.get("time_limited")
                                                     else "")


def totals(rows: list[dict[str, Any]], spaces: list[str]) -> list[str]:
    """One line per Galvatron space: the wall seconds of its rows summed, against ours in the
    full space and in its space (rows Galvatron did not finish make the ratios lower bounds)."""
    out = []
    for space in spaces:
        mine = [r for r in rows if r["space"] == space]
        if not mine:
            continue
        g = sum(r["g_wall"] for r in mine)
        full = sum(r["ours_wall"] for r in mine)
        same = sum(r["same_wall"] for r in mine)
        more = "more than " if any(r["timed_out"] for r in mine) else ""
        out.append(f"- Galvatron's {space!r} space, {len(mine)} rows: Galvatron {more}{g:.1f} s; "
                   f"ours in the full space {full:.1f} s ({more}x{g / full:.1f}), ours in "
                   f"Galvatron's space {same:.1f} s ({more}x{g / same:.1f}), wall.")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(CASES))
    parser.add_argument("--budgets", type=int, nargs="+", default=None, metavar="GB",
                        help="only these budgets of the chosen cases")
    parser.add_argument("--galvatron-venv", type=Path, default=None,
                        help="build (or reuse) Galvatron's venv here instead of a throwaway one")
    parser.add_argument("--galvatron-source", type=Path,
                        default=os.environ.get("GALVATRON_SOURCE") or None, metavar="PATH",
                        help="install Galvatron from this local sdist or directory, offline "
                             "(default: $GALVATRON_SOURCE, else the package index)")
    parser.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                        help="install numpy, scipy, tqdm, pybind11 from these wheels only")
    parser.add_argument("--galvatron-timeout", type=float, default=None, metavar="SECONDS",
                        help="stop a Galvatron search after this long (its time and the ratio "
                             "are then printed as lower bounds)")
    parser.add_argument("--keep-galvatron", type=Path, default=None, metavar="DIR",
                        help="store Galvatron's results (times, plans) in DIR and reuse stored "
                             "ones: re-measure ours after a change without re-running it (a "
                             "working aid: refused with --table-out, whose table runs both)")
    parser.add_argument("--galvatron-spaces", nargs="+", choices=list(GALVATRON_SPACES),
                        default=list(GALVATRON_SPACES), metavar="SPACE",
                        help="Galvatron's spaces to run, each against ours: "
                             + ", ".join(repr(k) for k in GALVATRON_SPACES) + " (default: both)")
    parser.add_argument("--table-out", type=Path, default=None, metavar="FILE",
                        help="also write the table (Markdown, with the run's load) to FILE")
    args = parser.parse_args()
    if args.keep_galvatron and args.table_out:
        parser.error("--keep-galvatron with --table-out: a published table measures "
                     "Galvatron in the same run as ours; drop --keep-galvatron")
    if args.keep_galvatron:
        args.keep_galvatron.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="bench_vs_galvatron_") as tmp:
        work_root = Path(tmp)
        _PYCACHE["dir"] = str(work_root / "pycache")
        python = make_venv(args.galvatron_venv or work_root / "venv", args.galvatron_source,
                           args.wheels)
        root = galvatron_root(python)
        startup_ours()  # untimed: fills our bytecode cache
        loads = [os.getloadavg()[0]]
        emit(f"our start-up (python + import megatron_auto.cli, as the console entry): "
             f"{startup_ours():.2f} s; "
             f"load average {loads[0]:.1f} on {os.cpu_count()} CPUs")
        emit("")
        emit(HEADER)
        emit("|" + "---|" * HEADER.count(" | ") + "---|")
        rows: list[dict[str, Any]] = []
        for name, case in CASES.items():
            if args.only and name != args.only:
                continue
            work = work_root / name
            work.mkdir()
            files = shipped_files(root, case)
            staged = _stage_for_galvatron(case, files, work / "staged")
            import_s, import_cpu, profile, cluster = import_ours(case, files, work)
            budgets = [b for b in case["budgets"] if not args.budgets or b in args.budgets]
            spaces = [sp for sp in args.galvatron_spaces
                      if sp in case.get("galvatron_spaces", GALVATRON_SPACES)]
            for budget, space in [(b, sp) for b in budgets for sp in spaces]:
                load_before = os.getloadavg()[0]
                g = run_galvatron(python, case, staged, budget, work, args.keep_galvatron,
                                  args.galvatron_timeout, space)
                plan_s, plan_cpu, info, plan = plan_ours(case, profile, cluster, budget, work)
                ours_s, ours_cpu = import_s + plan_s, import_cpu + plan_cpu
                same_s, same_cpu, same_info, same_plan = plan_ours(case, profile, cluster,
                                                                   budget, work, space)
                same_s, same_cpu = import_s + same_s, import_cpu + same_cpu
                est_ours = evaluate_ours(case, profile, cluster, budget, ["--plan", str(plan)])
                est_same = evaluate_ours(case, profile, cluster, budget,
                                         ["--plan", str(same_plan)])
                est_g = (evaluate_ours(case, profile, cluster, budget,
                                       ["--galvatron-config", g["config"]])
                         if g["config"] else {"error": "stopped" if g.get("timed_out")
                                              else "Galvatron found no plan"})
                loads += [load_before, os.getloadavg()[0]]
                reused = " stored" if g.get("reused") else ""
                more = "> " if g.get("timed_out") else ""
                g_txt = (f"> {g['wall_s']:.0f} (stopped)" if more
                         else f"{g['wall_s']:.1f} ({g['search_s']:.1f})")
                g_cpu = g.get("cpu_s", float("nan"))

                def ratio(wall: float, cpu: float) -> str:
                    cpu_txt = f"{more}x{g_cpu / cpu:.1f}" if g_cpu == g_cpu else "n/a"
                    return f"{more}x{g['wall_s'] / wall:.1f} ({cpu_txt})"

                rows.append({"space": space, "g_wall": g["wall_s"], "ours_wall": ours_s,
                             "same_wall": same_s, "timed_out": bool(more)})
                emit(f"| {case['label']} | {budget} GB | {space} | {g_txt}{reused} | "
                     f"{import_s:.2f} + {plan_s:.2f} = {ours_s:.2f} "
                     f"({info.get('search_cpu_s', float('nan')):.2f}) | "
                     f"{ratio(ours_s, ours_cpu)} | {_proven(info)} | {_gap(info)} | "
                     f"{import_s:.2f} + {same_s - import_s:.2f} = {same_s:.2f} "
                     f"({same_info.get('search_cpu_s', float('nan')):.2f}) | "
                     f"{ratio(same_s, same_cpu)} | {_gap(same_info)} | "
                     f"{_throughput(est_g)} / {_throughput(est_same)} / "
                     f"{_throughput(est_ours)} | {load_before:.1f}-{loads[-1]:.1f} |")
        emit("")
        emit(f"Load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs during "
             f"the run. Totals:")
        emit("")
        for line in totals(rows, args.galvatron_spaces):
            emit(line)
    if args.table_out:
        args.table_out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
