"""Process start to written plan for ``megatron-auto plan``, and where the time goes.

    python benchmarks/bench_cli_start.py            # 5 repeats of each, medians
    python benchmarks/bench_cli_start.py --repeats 9 --table-out start.md

The problem: BERT-Large (24 layers, hidden 1024, 16 heads, seq 512, bf16, global batch 64) on
the ``a100-40g-1x8`` preset (analytic profile), ``--quiet``. Target: under 0.3 s from process
start to the plan file on disk.

Each row is a fresh interpreter timed from spawn to exit, with the children's CPU time next to
the wall time because a shared machine inflates the latter. The children compile to a bytecode
cache (a temporary ``PYTHONPYCACHEPREFIX``, warmed by one untimed run of each command) as an
installed package does, even where the environment sets ``PYTHONDONTWRITEBYTECODE``: compiling
every module on every start is not what a user pays. Rows:

- ``python -c pass``: the interpreter's own start and exit, which no change to the package can
  remove;
- ``import numpy``: the planner's one dependency (its arrays), with ``OPENBLAS_NUM_THREADS=1``
  and ``os._exit`` as the console entry runs it (``megatron_auto/console.py``), and as a plain
  ``python -c "import numpy"`` for comparison;
- ``import megatron_auto.cli``: everything the command imports (no torch: see
  tests/test_torch_free.py), in the same setting as numpy's first row;
- ``import torch``: what the planning path would pay if it imported torch;
- ``megatron-auto plan``: the console script's entry (``python -m megatron_auto``, which calls
  what the installed ``megatron-auto`` calls), start to exit;
- its split, from a fresh interpreter per run that times itself (``_SPLIT``): the imports, the
  search (``planner.search`` as the command calls it, baselines included), the rest of
  ``main`` (report and plan file), and what is left of the process's time (the interpreter's
  start and exit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "512", "--vocab-size", "30522", "--model-type", "bert", "--bf16",
         "--global-batch-size", "64", "--cluster", "a100-40g-1x8"]
TARGET_S = 0.3


_CACHE: dict[str, str] = {}
# What the console entry does before numpy loads and after the output is written
# (megatron_auto/console.py), for the import rows measured in the same setting.
_CONSOLE_LIKE = "import os; os.environ.setdefault('OPENBLAS_NUM_THREADS', '1'); {}; os._exit(0)"

# A fresh interpreter that times its own parts of the command: imports, the search, the rest of
# main (report and plan file); prints them as JSON on the last line (the command's own output
# goes to a null device). The search is timed by wrapping planner.search.search where the CLI
# calls it.
_SPLIT = """
import json, os, sys, time
w0, c0 = time.perf_counter(), time.process_time()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
from megatron_auto import cli
w1, c1 = time.perf_counter(), time.process_time()
search_module = sys.modules["megatron_auto.planner.search.driver"]
real, spent = search_module.search, [0.0, 0.0]
def timed(*args, **kwargs):
    w, c = time.perf_counter(), time.process_time()
    try:
        return real(*args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - w
        spent[1] += time.process_time() - c
search_module.search = timed
if getattr(cli, "search", None) is real:
    cli.search = timed
out, sys.stdout = sys.stdout, open(os.devnull, "w")
code = cli.main(sys.argv[1:])
sys.stdout.flush()
sys.stdout = out
w2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"code": code, "imports": [w1 - w0, c1 - c0], "search": spent,
                  "rest": [w2 - w1 - spent[0], c2 - c1 - spent[1]]}))
sys.stdout.flush()
os._exit(code)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env["PYTHONPYCACHEPREFIX"] = _CACHE["dir"]
    return env


def _child(argv: list[str], capture: bool = False) -> tuple[float, float, str]:
    """(wall, CPU) seconds of one fresh interpreter running ``argv``, and its stdout if
    ``capture``."""
    env = _env()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], check=True, env=env, cwd=REPO,
                          stdout=subprocess.PIPE if capture else subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout or ""


def _median(argv: list[str], repeats: int) -> tuple[float, float]:
    _child(argv)  # untimed: fills the bytecode cache
    runs = [_child(argv) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _split(command: list[str], repeats: int) -> dict[str, tuple[float, float]]:
    """Medians of (wall, CPU) per part of the command, each run a fresh interpreter."""
    argv = ["-c", _SPLIT, *command]
    _child(argv)  # untimed: fills the bytecode cache
    parts: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeats):
        wall, cpu, text = _child(argv, capture=True)
        got = json.loads(text.strip().splitlines()[-1])
        assert got["code"] == 0, got
        timed = {k: tuple(got[k]) for k in ("imports", "search", "rest")}
        inside = [sum(v[j] for v in timed.values()) for j in (0, 1)]
        timed["interpreter"] = (wall - inside[0], cpu - inside[1])
        for k, v in timed.items():
            parts.setdefault(k, []).append(v)
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--table-out", default=None, metavar="FILE",
                        help="also write the rows as a Markdown table (docs/cli.md)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _CACHE["dir"] = str(Path(tmp) / "pycache")
        out = str(Path(tmp) / "plan.json")
        command = ["plan", *MODEL, "--plan-out", out, "--quiet"]
        load_before = os.getloadavg()[0]
        rows = {
            "python -c pass": _median(["-c", "pass"], args.repeats),
            "import numpy (1 BLAS thread, os._exit)": _median(
                ["-c", _CONSOLE_LIKE.format("import numpy")], args.repeats),
            "import numpy (plain)": _median(["-c", "import numpy"], args.repeats),
            "import megatron_auto.cli (1 BLAS thread, os._exit)": _median(
                ["-c", _CONSOLE_LIKE.format("import megatron_auto.cli")], args.repeats),
            "import torch": _median(["-c", "import torch"], args.repeats),
            "megatron-auto plan (start -> plan.json -> exit)": _median(
                ["-m", "megatron_auto", *command], args.repeats),
        }
        assert Path(out).is_file()
        split = _split(command, args.repeats)
        load = (load_before + os.getloadavg()[0]) / 2
    total_wall, total_cpu = rows["megatron-auto plan (start -> plan.json -> exit)"]
    names = {"interpreter": "  interpreter start and exit", "imports": "  imports",
             "search": "  search (baselines included)", "rest": "  report and plan file"}
    print(f"megatron-auto plan, BERT-Large on a100-40g-1x8 ({args.repeats} repeats, medians; "
          f"load average {load:.1f} on {os.cpu_count()} CPUs)")
    print(f"{'':52s} {'wall s':>8s} {'cpu s':>8s} {'x target':>9s}")
    for name, (wall, cpu) in rows.items():
        print(f"{name:52s} {wall:8.3f} {cpu:8.3f} {wall / TARGET_S:9.2f}")
    print("split of the command (a fresh interpreter timing its own parts):")
    for key, name in names.items():
        wall, cpu = split[key]
        print(f"{name:52s} {wall:8.3f} {cpu:8.3f}")
    print(f"\nstart -> plan: {total_wall:.3f} s = {total_wall / TARGET_S:.2f} x the {TARGET_S} s "
          f"target (CPU {total_cpu:.3f} s)")
    torch_extra = rows["import torch"][0] - rows["python -c pass"][0]
    print(f"importing torch alone would add {torch_extra:.3f} s "
          f"({torch_extra / total_wall:.1f} x the whole command now)")
    if args.table_out:
        lines = [f"| process (fresh interpreter, {args.repeats} runs, medians; load average "
                 f"{load:.1f} on {os.cpu_count()} CPUs) | wall s | CPU s |",
                 "|---|---|---|"]
        lines += [f"| `{name}` | {wall:.3f} | {cpu:.3f} |" for name, (wall, cpu) in rows.items()]
        lines += [f"| {name.strip()} (of the command) | {split[key][0]:.3f} | "
                  f"{split[key][1]:.3f} |" for key, name in names.items()]
        Path(args.table_out).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
