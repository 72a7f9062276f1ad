"""Optimizer offload's priced device and host memory against the runtime's, on CPU.

The tiny GPT of tests/test_cost_memory_measured.py (4 layers, h 64, s 32, vocabulary 512,
fp32) on 2 gloo ranks: ``ddp`` layers with recompute, the tied vocabulary in ``zero1`` or
``ddp``, at ``pipeline.optimizer_offload_fraction`` 0, 1/2 and 1. Each plan trains three
iterations under the runtime's meter (parallel/memory.py, which on CPU takes the host share out
of the device peak); the cost model prices it with its measured profile (no context reserve,
as the CPU meter has none). Prints, per plan, the estimated and measured steady-state device
peak (rank 0) and their ratio, the estimated and the runtime's host bytes, and what offloading
everything saves against fraction 0 measured in the same run::

    python benchmarks/validate_optimizer_offload.py

It prints what it measured; it asserts nothing (tests/test_optimizer_offload_cost.py does).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from dist_utils import run_distributed  # noqa: E402
from test_cost_memory_measured import _plan_estimate  # noqa: E402
from test_optimizer_offload_cost import GPT, _estimate, _plan, _run  # noqa: E402
from megatron_auto.profiler.lookup import get_or_create_model_profile  # noqa: E402

FRACTIONS = (0.0, 0.5, 1.0)


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        profile = get_or_create_model_profile(GPT, "fp32", torch.device("cpu"), cache_dir=cache)
        for vocab in ("zero1", "ddp"):
            device = {}
            for fraction in FRACTIONS:
                plan = _plan(vocab, fraction)
                (estimated,) = _plan_estimate(plan, profile)
                run = run_distributed(_run, 2, plan.to_dict())[0]
                host = _estimate(plan, profile).host_memory_bytes
                measured = run["peaks"][1]
                device[fraction] = (estimated, measured)
                print(f"vocab {vocab:5s} fraction {fraction:.1f}: device estimate {estimated:,.0f} B"
                      f" measured {measured:,} B ratio {estimated / measured:.3f}; host estimate "
                      f"{host:,.0f} B runtime {run['host']:,} B")
            saved_est = device[0.0][0] - device[1.0][0]
            saved_meas = device[0.0][1] - device[1.0][1]
            print(f"vocab {vocab:5s}: fraction 1 saves {saved_est:,.0f} B estimated, "
                  f"{saved_meas:,} B measured against fraction 0 (ratio "
                  f"{saved_est / saved_meas:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
