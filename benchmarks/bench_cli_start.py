"""Process start to written plan for ``megatron-auto plan``, and where the time goes.

    python benchmarks/bench_cli_start.py            # 5 repeats of each, medians
    python benchmarks/bench_cli_start.py --repeats 9 --table-out start.md

The problem: BERT-Large (24 layers, hidden 1024, 16 heads, seq 512, bf16, global batch 64) on
the ``a100-40g-1x8`` preset (analytic profile), ``--quiet``. Target: under 0.3 s from process
start to the plan file on disk.

Each row is a fresh interpreter (``python -m megatron_auto.cli plan ...``, what the console
script runs), timed from spawn to exit, with the children's CPU time next to the wall time
because a shared machine inflates the latter. The children compile to a bytecode cache (a
temporary ``PYTHONPYCACHEPREFIX``, warmed by one untimed run of each command) as an installed
package does, even where the environment sets ``PYTHONDONTWRITEBYTECODE``: compiling every
module on every start is not what a user pays. Baselines measured in the same run:

- ``python -c pass``: the interpreter's own start, which no change to the package can remove;
- ``import numpy``: the planner's one dependency (its arrays), the floor of any command that
  plans;
- ``import megatron_auto.cli``: everything the command imports (no torch: see
  tests/test_torch_free.py);
- ``import torch``: what the planning path would pay if it imported torch;
- in-process split of the command itself: the search alone (``planner.search`` with the
  command's options, baselines included as the command prints them) against the whole ``main``.
"""

from __future__ import annotations

import argparse
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


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env["PYTHONPYCACHEPREFIX"] = _CACHE["dir"]
    return env


def _child(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh interpreter running ``argv``."""
    env = _env()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], check=True, env=env, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _median(argv: list[str], repeats: int) -> tuple[float, float]:
    _child(argv)  # untimed: fills the bytecode cache
    runs = [_child(argv) for _ in range(repeats)]
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def _in_process_split(out: str, repeats: int) -> tuple[float, float]:
    """(search alone, whole main()) seconds, medians, with every import already paid."""
    from megatron_auto import cli
    from megatron_auto.planner.search import SearchOptions, search

    args = cli.build_parser().parse_args(["plan", *MODEL, "--plan-out", out, "--quiet"])
    setup = cli._setup(args)  # noqa: SLF001 - the command's own planning inputs
    searches, mains = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        search(setup.spec, setup.training, setup.cluster, setup.profile, setup.budget_bytes,
               SearchOptions(show_progress=False))
        searches.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        devnull = open(os.devnull, "w")
        stdout, sys.stdout = sys.stdout, devnull
        try:
            cli.main(["plan", *MODEL, "--plan-out", out, "--quiet"])
        finally:
            sys.stdout = stdout
            devnull.close()
        mains.append(time.perf_counter() - t0)
    return statistics.median(searches), statistics.median(mains)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--table-out", default=None, metavar="FILE",
                        help="also write the rows as a Markdown table (docs/planner.md §7)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _CACHE["dir"] = str(Path(tmp) / "pycache")
        out = str(Path(tmp) / "plan.json")
        rows = {
            "python -c pass": _median(["-c", "pass"], args.repeats),
            "import numpy": _median(["-c", "import numpy"], args.repeats),
            "import megatron_auto.cli": _median(["-c", "import megatron_auto.cli"],
                                                args.repeats),
            "import torch": _median(["-c", "import torch"], args.repeats),
            "megatron-auto plan (start -> plan.json)": _median(
                ["-m", "megatron_auto.cli", "plan", *MODEL, "--plan-out", out, "--quiet"],
                args.repeats),
        }
        assert Path(out).is_file()
        search_s, main_s = _in_process_split(out, args.repeats)
    total_wall, total_cpu = rows["megatron-auto plan (start -> plan.json)"]
    print(f"megatron-auto plan, BERT-Large on a100-40g-1x8 ({args.repeats} repeats, medians)")
    print(f"{'':44s} {'wall s':>8s} {'cpu s':>8s} {'x target':>9s}")
    for name, (wall, cpu) in rows.items():
        print(f"{name:44s} {wall:8.3f} {cpu:8.3f} {wall / TARGET_S:9.2f}")
    print(f"{'  in-process: search (with baselines)':44s} {search_s:8.3f}")
    print(f"{'  in-process: whole main()':44s} {main_s:8.3f}")
    floor = rows["python -c pass"][0]
    imports = rows["import megatron_auto.cli"][0] - floor
    print(f"\nstart -> plan: {total_wall:.3f} s = {total_wall / TARGET_S:.2f} x the {TARGET_S} s "
          f"target (CPU {total_cpu:.3f} s); of it: interpreter {floor:.3f} s, package imports "
          f"{imports:.3f} s, search {search_s:.3f} s ({search_s / total_wall:.0%}), the rest "
          f"(report, write) {max(main_s - search_s, 0.0):.3f} s")
    print(f"importing torch alone would add {rows['import torch'][0] - floor:.3f} s "
          f"({(rows['import torch'][0] - floor) / total_wall:.1f} x the whole command now)")
    if args.table_out:
        lines = [f"| process (fresh interpreter, {args.repeats} runs, medians; load average "
                 f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs) | wall s | CPU s |",
                 "|---|---|---|"]
        lines += [f"| `{name}` | {wall:.3f} | {cpu:.3f} |" for name, (wall, cpu) in rows.items()]
        lines.append(f"| in-process: the search alone (baselines included) | {search_s:.3f} | |")
        Path(args.table_out).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
