"""What the profilers record for the cost model's GPU terms: the SDPA kernel a layer ran (read
from op names, on any device) and the GPU fields a CUDA hardware profile writes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_auto.planner.inputs.hardware import ATTENTION_BACKENDS
from megatron_auto.profiler.hardware_profiler import HardwareProfile
from megatron_auto.profiler.sdpa_probe import backend_from_op_names, sdpa_backend

pytestmark = pytest.mark.single


def test_backend_from_op_names():
    assert backend_from_op_names(["aten::linear", "aten::_scaled_dot_product_flash_attention"]) \
        == "flash"
    assert backend_from_op_names(["aten::_scaled_dot_product_efficient_attention"]) == "efficient"
    assert backend_from_op_names(["aten::_scaled_dot_product_cudnn_attention"]) == "cudnn"
    assert backend_from_op_names(["aten::_scaled_dot_product_flash_attention_for_cpu"]) == "flash"
    assert backend_from_op_names(["aten::bmm", "aten::softmax"]) == "math"


def test_sdpa_backend_sees_the_kernel_that_ran():
    q = torch.randn(1, 2, 16, 8)

    def attend():
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_backend(attend) == "math"
    assert sdpa_backend(attend) in ATTENTION_BACKENDS  # whatever torch picks on this CPU


def test_cuda_hardware_profile_writes_the_gpu_terms():
    common = dict(world_size=1, devices_per_node=1, device_name="NVIDIA H100 80GB HBM3",
                  device_memory_bytes=80 * 2**30, backend="nccl", memory_reserve_bytes=2**30)
    gpu = HardwareProfile(**common, device_type="cuda", nccl_communicator_bytes=3e8,
                          hbm_bandwidth=3.0e12).to_cluster_spec()
    assert (gpu.hbm_bandwidth, gpu.nccl_communicator_bytes) == (3.0e12, 3e8)
    assert gpu.attention_backend == "flash" and gpu.fused_optimizer
    assert 0 < gpu.fragmentation_fraction < 1
    cpu = HardwareProfile(**{**common, "backend": "gloo"}).to_cluster_spec()
    assert (cpu.hbm_bandwidth, cpu.attention_backend, cpu.fused_optimizer) == (0.0, "math", False)
