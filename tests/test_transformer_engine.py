"""--transformer-impl transformer_engine and apex's fused norms, through CPU stand-ins.

The stand-ins (tests/te_standins.py) have Transformer Engine's and apex's constructor and call
signatures and our local layers' numerics, so these tests check the wiring: the arguments each
TE module receives (TP group and size, parallel mode, norm, mask type, layout), that the TE layer
has the local layer's parameter names and shapes, that it computes the local numbers (single
process with dropout, rotary, masks, SwiGLU/RMSNorm; 2 TP ranks through the trainer), and that a
checkpoint of one implementation resumes exactly in the other. Where Transformer Engine
imports with CUDA, ``test_real_te_layer_computes_the_local_numbers_on_cuda`` runs the real TE
layer against the local one on the GPU, and tests/test_te_signatures.py compares the stand-ins'
signatures with TE's; elsewhere both skip, saying why (.ci/expected_skips.txt). FP8 itself is
not exercised here (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import te_standins
from harness import Job, Recipe, layer, plan_of, run_jobs
from test_equivalence import CONFIG, make_batch
from megatron_auto.config import ConfigError, ModelConfig
from megatron_auto.families.registry import family_of
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.training.lr_scheduler import LRConfig
from megatron_auto.parallel.random import RNGTracker
from megatron_auto.profiler.measure import tp1_groups

REPO = Path(__file__).resolve().parents[1]
TE = dataclasses.replace(CONFIG, transformer_impl="transformer_engine")


@pytest.fixture
def standins(monkeypatch):
    return te_standins.install(monkeypatch)


def _layers(config, causal=True, dropout=False, device=torch.device("cpu")):
    from megatron_auto.models.te_layers import make_transformer_layer

    groups = tp1_groups(device)
    out = []
    for impl in ("local", "transformer_engine"):
        cfg = dataclasses.replace(config, transformer_impl=impl,
                                  fp8_format=config.fp8_format if impl != "local" else None)
        rng = RNGTracker(7, stage=0, local_index=0, device=device) if dropout else None
        torch.manual_seed(0)
        out.append(make_transformer_layer(cfg, groups, rng=rng, causal=causal, device=device))
    local, te = out
    with torch.no_grad():  # the same values, by name: names and shapes must match
        te_params = dict(te.named_parameters())
        for name, p in local.named_parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
            te_params[name].copy_(p)
    return local, te


@pytest.mark.single
def test_te_modules_get_te_arguments(standins):
    cfg = dataclasses.replace(TE, fp8_format="hybrid", normalization="rmsnorm",
                              activation="swiglu", attention_dropout=0.1)
    _layers(cfg, causal=True, dropout=True)
    calls = [(kind, kw) for kind, kw in standins if kind != "FusedLayerNorm"]
    kinds = [kind for kind, _ in calls]
    assert kinds == ["LayerNormLinear", "DotProductAttention", "Linear", "LayerNormLinear",
                     "Linear"]
    qkv, core, proj, fc1, fc2 = (kw for _, kw in calls)
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    assert (qkv["in_features"], qkv["out_features"], qkv["parallel_mode"]) == (h, 3 * h, "column")
    assert core["num_gqa_groups"] == cfg.num_attention_heads  # no grouped-query attention here
    assert qkv["normalization"] == "RMSNorm" and qkv["eps"] == cfg.layernorm_epsilon
    assert (fc1["out_features"], fc1["parallel_mode"]) == (2 * f, "column")  # SwiGLU gate+up
    assert (proj["parallel_mode"], fc2["parallel_mode"], fc2["in_features"]) == ("row", "row", f)
    for kw in (qkv, proj, fc1, fc2):
        assert kw["tp_group"] is None and kw["tp_size"] == 1 and kw["sequence_parallel"] is False
        assert kw["params_dtype"] == torch.float32 and kw["bias"] is True
    assert (core["num_attention_heads"], core["kv_channels"]) == (cfg.num_attention_heads,
                                                                  cfg.head_dim)
    assert core["qkv_format"] == "bshd" and core["attn_mask_type"] == "causal"
    assert core["attention_dropout"] == 0.1 and callable(core["get_rng_state_tracker"])


@pytest.mark.single
def test_te_layer_has_the_local_parameter_names_and_shapes(standins):
    for cfg in (TE, dataclasses.replace(TE, normalization="rmsnorm", activation="swiglu")):
        local, te = _layers(cfg)
        assert [(n, p.shape) for n, p in local.named_parameters()] == [
            (n, p.shape) for n, p in te.named_parameters()]


@pytest.mark.single
@pytest.mark.parametrize("variant", ["gpt-dropout", "bert-mask", "rope-swiglu-rmsnorm",
                                     "recompute", "gqa-nobias-openai-gelu"])
def test_te_layer_computes_the_local_numbers(standins, variant):
    from megatron_auto.models.transformer import RotaryEmbedding

    cfg = dataclasses.replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1)
    causal, mask, rotary = True, None, None
    if variant == "rope-swiglu-rmsnorm":
        cfg = dataclasses.replace(cfg, position_embedding_type="rope", activation="swiglu",
                                  normalization="rmsnorm")
        rotary = RotaryEmbedding(cfg.head_dim, cfg.seq_length).tables(cfg.seq_length)
    if variant == "gqa-nobias-openai-gelu":
        cfg = dataclasses.replace(cfg, num_attention_heads=4, num_query_groups=2,
                                  add_bias_linear=False, openai_gelu=True)
    if variant == "bert-mask":
        causal = False
        keep = torch.ones(2, cfg.seq_length, dtype=torch.bool)
        keep[1, -5:] = False
        mask = keep[:, None, None, :]
    local, te = _layers(cfg, causal=causal, dropout=True)
    if variant == "recompute":
        local.recompute = te.recompute = True
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size)
    outs = []
    for module in (local, te):
        xi = x.clone().requires_grad_(True)
        y = module(xi, mask, rotary)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-6, msg=name)


def _real_te_with_cuda() -> str:
    """Why the real-TE test cannot run here ("" where it can)."""
    if not torch.cuda.is_available():
        return "needs Transformer Engine with CUDA (no CUDA device here)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - TE's import can raise more than ImportError
        return f"needs Transformer Engine with CUDA (it does not import: {type(exc).__name__})"
    return ""


@pytest.mark.single
@pytest.mark.parametrize("variant", ["gpt", "rope-swiglu-rmsnorm-gqa"])
def test_real_te_layer_computes_the_local_numbers_on_cuda(variant):
    """Where Transformer Engine imports with CUDA: the real TE layer (TE's kernels, no
    stand-in) against our local layer on the GPU, fp32, dropout off, same weights by name.
    Tolerance 1e-4 relative (TE's fused kernels reorder sums; TF32 off). Not yet run: no
    GPU with TE has been available (README "GPUs: what was verified where")."""
    reason = _real_te_with_cuda()
    if reason:
        pytest.skip(reason)
    from megatron_auto.models.transformer import RotaryEmbedding

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg, rotary, device = CONFIG, None, torch.device("cuda")
    if variant == "rope-swiglu-rmsnorm-gqa":
        cfg = dataclasses.replace(cfg, position_embedding_type="rope", activation="swiglu",
                                  normalization="rmsnorm", num_attention_heads=4,
                                  num_query_groups=2)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.seq_length).tables(cfg.seq_length)
        rotary = tuple(t.to(device) for t in rotary)  # (cos, sin)
    local, te = _layers(cfg, causal=True, device=device)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, device=device)
    outs = []
    for module in (local, te):
        xi = x.clone().requires_grad_(True)
        y = module(xi, None, rotary)
        (y * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.single
def test_fp8_recipe_wraps_the_layer_without_amax_collectives(standins):
    _, te = _layers(dataclasses.replace(TE, fp8_format="e4m3"))
    standins.clear()
    te(torch.randn(2, CONFIG.seq_length, CONFIG.hidden_size))
    (kind, kw), = standins
    assert kind == "fp8_autocast" and kw["enabled"]
    assert kw["fp8_recipe"].fp8_format.name == "E4M3" and kw["fp8_recipe"].reduce_amax is False


@pytest.mark.single
def test_apex_fused_norm_is_used_when_asked_and_keeps_names_and_numbers(standins):
    from megatron_auto.models.transformer import TransformerLayer, make_norm

    assert type(make_norm(CONFIG, fused=True)).__name__ == "FusedLayerNorm"
    rms = dataclasses.replace(CONFIG, normalization="rmsnorm")
    assert type(make_norm(rms, fused=True)).__name__ == "FusedRMSNorm"
    assert type(make_norm(CONFIG)) is torch.nn.LayerNorm
    groups = tp1_groups(torch.device("cpu"))
    torch.manual_seed(0)
    plain = TransformerLayer(CONFIG, groups)
    fused = TransformerLayer(CONFIG, groups, fused_norm=True)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in fused.named_parameters()]
    with torch.no_grad():  # the linear layers' parameters are allocated uninitialised
        for p in plain.parameters():
            p.normal_(0.0, 0.3)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, CONFIG.seq_length, CONFIG.hidden_size)
    torch.testing.assert_close(fused(x), plain(x))


@pytest.mark.single
def test_sequence_parallel_with_te_is_refused_clearly(standins):
    from megatron_auto.models.te_layers import TransformerImplError, make_transformer_layer

    with pytest.raises(TransformerImplError, match="sequence parallelism"):
        make_transformer_layer(TE, tp1_groups(torch.device("cpu")), sequence_parallel=True)


@pytest.mark.single
def test_te_that_does_not_import_is_one_config_error(monkeypatch):
    from megatron_auto.models.te_layers import TransformerImplError, make_transformer_layer

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(TransformerImplError, match="does not import here") as info:
        make_transformer_layer(TE, tp1_groups(torch.device("cpu")))
    assert isinstance(info.value, ConfigError) and "\n" not in str(info.value)


def _recipe(config: ModelConfig) -> Recipe:
    """The tiny GPT with the trainer's default optimizer and LR (the local or the TE layers)."""
    return Recipe(config, family_of(config).build_stage, make_batch,
                  optimizer=OptimizerConfig(), lr=LRConfig())


@pytest.mark.multirank
def test_te_trains_the_local_numbers_on_two_tp_ranks_and_resumes_a_local_checkpoint(
        standins, tmp_path):
    plan = plan_of(2, [layer(tp=2), layer(tp=2), layer(tp=1), layer(tp=2, dp_mode="zero3")],
                   vocab_tp=2)
    ckpt = str(tmp_path / "ckpt")
    local, te, _, resumed = run_jobs(2, [  # one fork: the stand-ins are installed in it
        Job(_recipe(CONFIG), plan, 0, 4), Job(_recipe(TE), plan, 0, 2),
        Job(_recipe(CONFIG), plan, 0, 2, save_dir=ckpt),
        Job(_recipe(TE), plan, 2, 4, load_dir=ckpt)])  # the local checkpoint, TE layers
    assert te.losses == pytest.approx(local.losses[:2], rel=1e-6)
    assert resumed.losses == pytest.approx(local.losses[2:], rel=1e-5)
    assert set(resumed.state) == set(local.state)
    for name, value in local.state.items():
        torch.testing.assert_close(resumed.state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.single
@pytest.mark.parametrize("argv, needle", [
    (["--transformer-impl", "transformer_engine"], "--transformer-impl=transformer_engine: "
                                                   "Transformer Engine is not installed here"),
    (["--fp8-format", "hybrid"], "--fp8-format=hybrid: needs --transformer-impl "
                                 "transformer_engine"),
])
def test_bad_transformer_impl_flags_are_one_error_line(argv, needle):
    if argv[0] == "--transformer-impl" and __import__("importlib").util.find_spec(
            "transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here: the flag is valid")
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), "--mock-data",
                           "--train-iters", "1", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {lines[0][7:]}"] and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.single
def test_model_config_refuses_fp8_without_te():
    with pytest.raises(ConfigError, match="--fp8-format=hybrid: needs --transformer-impl"):
        ModelConfig(fp8_format="hybrid")
    with pytest.raises(ConfigError, match="--transformer-impl=apex"):
        ModelConfig(transformer_impl="apex")
