"""The MoE block (models/moe.py) against the token-by-token reference (tests/reference/moe.py).

One process, fp32. Per routing variant: the block's output, its gradients (input, router,
experts, shared experts) under an upstream gradient plus the auxiliary losses, the summed
balance and z-losses and the kept tokens per expert must match the reference within relative
1e-5 (absolute 1e-6 for values near zero). The weights are random tensors handed to both sides
(router logits O(1), so the top-k choices are far from ties).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_auto.config import ConfigError, ModelConfig
from megatron_auto.families.gpt.config import MoEConfig, MoEConfigError
from megatron_auto.layout import StageLayout
from megatron_auto.models.moe import MoELayer, grouped_linear
from megatron_auto.parallel.context import LayerGroups
from reference.moe import RefMoE, moe_forward

pytestmark = pytest.mark.single

RTOL, ATOL = 1e-5, 1e-6


def one_rank_groups() -> LayerGroups:
    return LayerGroups(layout=StageLayout(0, 1, True), tp_group=None, tp_rank=0, tp_size=1,
                       tp_ranks=[0], dp_group=None, dp_rank=0, dp_size=1, dp_ranks=[0])


def make_config(h: int = 16, **moe: object) -> ModelConfig:
    swiglu = moe.pop("activation", "swiglu") == "swiglu"
    return ModelConfig(num_layers=2, hidden_size=h, num_attention_heads=2, ffn_hidden_size=24,
                       seq_length=6, vocab_size=32, add_bias_linear=False,
                       activation="swiglu" if swiglu else "gelu",
                       moe=MoEConfig(**{"num_experts": 4, "ffn_hidden_size": 8, **moe}))


def weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Reference-named random weights (router rows ~ N(0, 1) over unit-scale inputs)."""
    moe = config.moe
    gen = torch.Generator().manual_seed(seed)
    h, f, e = config.hidden_size, config.expert_ffn_hidden_size, moe.num_experts

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols ** 0.5

    out = {"router": torch.randn(e, h, generator=gen) / h ** 0.5 * 2.0}
    names = ("gate", "up", "down") if config.activation == "swiglu" else ("fc1", "fc2")
    shared = moe.shared_expert_intermediate_size
    for who, width in [(f"e{i}", f) for i in range(e)] + ([("shared", shared)] if shared else []):
        for n in names:
            out[f"{who}.{n}"] = mat(h, width) if n in ("down", "fc2") else mat(width, h)
    return out


def load_into(layer: MoELayer, w: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """The reference's tensors in the package's documented layouts."""
    e = config.moe.num_experts
    swiglu = config.activation == "swiglu"

    def fc1(who: str) -> torch.Tensor:
        if swiglu:  # rows interleave (gate_0, up_0, gate_1, ...)
            return torch.stack([w[f"{who}.gate"], w[f"{who}.up"]], dim=1).flatten(0, 1)
        return w[f"{who}.fc1"]

    def fc2(who: str) -> torch.Tensor:
        return w[f"{who}.down" if swiglu else f"{who}.fc2"]

    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        layer.experts.linear_fc1.weight.copy_(torch.stack([fc1(f"e{i}") for i in range(e)]))
        layer.experts.linear_fc2.weight.copy_(torch.stack([fc2(f"e{i}") for i in range(e)]))
        if layer.shared_experts is not None:
            layer.shared_experts.linear_fc1.weight.copy_(fc1("shared"))
            layer.shared_experts.linear_fc2.weight.copy_(fc2("shared"))


CASES = {
    "top2-swiglu-shared-aux-z": dict(router_topk=2, shared_expert_intermediate_size=12,
                                     aux_loss_coeff=0.1, z_loss_coeff=0.01),
    "top1-gelu-pre-softmax": dict(router_topk=1, activation="gelu", router_pre_softmax=True,
                                  aux_loss_coeff=0.05),
    "top2-sigmoid-capacity": dict(router_topk=2, router_score_function="sigmoid",
                                  expert_capacity_factor=1.0, aux_loss_coeff=0.1),
    "top1-capacity-half": dict(router_topk=1, expert_capacity_factor=0.5, aux_loss_coeff=0.1,
                               z_loss_coeff=0.001),
    "top2-gelu-unaligned-loop": dict(h=6, router_topk=2, activation="gelu", z_loss_coeff=0.01),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_block_matches_token_by_token_reference(name):
    kwargs = dict(CASES[name])
    h = kwargs.pop("h", 16)
    activation = kwargs.get("activation", "swiglu")
    config = make_config(h, **kwargs)
    moe = config.moe
    layer = MoELayer(config, one_rank_groups())
    w = weights(config, seed=7)
    load_into(layer, w, config)
    scale = 0.37  # the aux losses' gradient (the trainer's loss_scale / batch)
    layer.aux_loss_scale = scale
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, config.seq_length, h, generator=gen)
    upstream = torch.randn(3, config.seq_length, h, generator=gen)

    xa = x.clone().requires_grad_(True)
    out = layer(xa)
    (out * upstream).sum().backward()

    ref_w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    xb = x.clone().requires_grad_(True)
    experts = [{n.split(".")[1]: ref_w[n] for n in ref_w if n.startswith(f"e{i}.")}
               for i in range(moe.num_experts)]
    shared = ({n.split(".")[1]: ref_w[n] for n in ref_w if n.startswith("shared.")}
              if moe.shared_expert_intermediate_size else None)
    cfg = RefMoE(moe.num_experts, moe.router_topk, activation, moe.router_score_function,
                 moe.router_pre_softmax, moe.expert_capacity_factor)
    ref_out, balance, zloss, counts = moe_forward(xb, ref_w["router"], experts, cfg, shared)
    aux = moe.aux_loss_coeff * sum(balance) + (moe.z_loss_coeff or 0.0) * sum(zloss)
    ((ref_out * upstream).sum() + scale * aux).backward()

    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    stats = layer.stats
    assert stats["tokens_per_expert"].tolist() == counts
    assert stats["sequences"].item() == 3
    torch.testing.assert_close(stats["balance_sum"].float(),
                               torch.stack(balance).sum().detach() if moe.aux_loss_coeff
                               else torch.tensor(0.0), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(stats["z_sum"].float(),
                               torch.stack(zloss).sum().detach() if moe.z_loss_coeff
                               else torch.tensor(0.0), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(layer.router.weight.grad, ref_w["router"].grad, rtol=RTOL,
                               atol=ATOL)
    grads = {k: v.grad for k, v in ref_w.items()}
    probe = MoELayer(config, one_rank_groups())
    with torch.no_grad():  # the reference's gradients in the package's layouts
        load_into(probe, {k: (g if g is not None else torch.zeros_like(w[k]))
                          for k, g in grads.items()}, config)
    for (pname, got), (_, want) in zip(layer.named_parameters(), probe.named_parameters()):
        torch.testing.assert_close(got.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=pname:
                                   f"{name}: {n}: {m}")


def test_capacity_drops_tokens_and_dropless_keeps_all():
    """A capacity below the sequence's assignments drops some, and dropless keeps all s*k
    assignments of each sequence."""
    config = make_config(router_topk=1, expert_capacity_factor=0.25)
    layer = MoELayer(config, one_rank_groups())
    load_into(layer, weights(config, seed=7), config)
    layer(torch.randn(3, config.seq_length, 16, generator=torch.Generator().manual_seed(3)))
    kept = layer.stats["tokens_per_expert"].sum().item()
    cap = 1  # ceil(0.25 * 6 * 1 / 4) per expert and sequence: 4 of each sequence's 6 at most
    assert kept <= 3 * 4 * cap < 3 * config.seq_length
    dropless = MoELayer(dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, expert_capacity_factor=None)), one_rank_groups())
    dropless(torch.randn(3, config.seq_length, 16))
    assert dropless.stats["tokens_per_expert"].sum().item() == 3 * config.seq_length


def test_grouped_linear_paths_agree_with_per_expert_matmuls():
    """The grouped GEMM (aligned rows) and the per-expert loop (unaligned), with an expert that
    gets no rows, against one matmul per expert; gradients too."""
    gen = torch.Generator().manual_seed(0)
    for inner in (8, 6):  # 32-byte rows: torch._grouped_mm; 24-byte rows: the loop
        x = torch.randn(9, inner, generator=gen, requires_grad=True)
        w = torch.randn(3, 4 * inner // 2, inner, generator=gen, requires_grad=True)
        counts = torch.tensor([4, 0, 5])
        y = grouped_linear(x, w, counts)
        y.sum().backward()  # an expanded gradient: the grouped GEMM's backward needs help
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        want = torch.cat([xr[:4] @ wr[0].T, xr[4:] @ wr[2].T])
        want.sum().backward()
        torch.testing.assert_close(y, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(x.grad, xr.grad, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(w.grad, wr.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kwargs, flag, value", [
    (dict(num_experts=4, router_topk=5), "--moe-router-topk", "5"),
    (dict(num_experts=4, expert_capacity_factor=0.0), "--moe-expert-capacity-factor", "0.0"),
    (dict(num_experts=4, expert_capacity_factor=-1.0), "--moe-expert-capacity-factor", "-1.0"),
    (dict(num_experts=0), "--num-experts", "0"),
    (dict(num_experts=4, router_score_function="relu"), "--moe-router-score-function", "relu"),
])
def test_bad_moe_settings_fail_in_one_line(kwargs, flag, value):
    with pytest.raises(MoEConfigError) as err:
        MoEConfig(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{flag}={value}:") and "\n" not in message


def test_moe_needs_bias_free_gpt():
    with pytest.raises(ConfigError, match="^--num-experts=4: .*add --disable-bias-linear$"):
        dataclasses.replace(make_config(), add_bias_linear=True).validate()


def _plan_with(ep: int = 1, *, layer: int = 0, tp: int = 1, world: int = 4, **fields):
    from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
    layers = [LayerStrategy(tp=tp) for _ in range(2)]
    layers[layer] = LayerStrategy(tp=tp, ep=ep, **fields)
    return Plan(world_size=world, global_batch_size=8, num_microbatches=1,
                pipeline=PipelineSpec(size=1, schedule="1f1b", layers_per_stage=(2,)),
                vocab=VocabStrategy(), layers=tuple(layers))


@pytest.mark.parametrize("make, field", [
    (lambda: _plan_with(ep=3), "layers[0].ep=3"),  # not a power of two dividing dp=4
    (lambda: _plan_with(ep=4, tp=2), "layers[0].ep=4"),  # dp is 2 at tp 2
    (lambda: _plan_with(ep=2, layer=1), "layers[1].ep=2"),  # layer 1 is dense
    (lambda: _plan_with(expert_tp=4, tp=2), "layers[0].expert_tp=4"),  # above tp
    (lambda: _plan_with(ep=2, expert_dp_mode="zero4"), "layers[0].expert_dp_mode=zero4"),
])
def test_bad_expert_fields_fail_in_one_line(make, field):
    from megatron_auto.plan import PlanError
    config = make_config(layer_freq=2)  # layer 0 MoE, layer 1 dense
    with pytest.raises(PlanError) as err:
        make().validate(config)
    message = str(err.value)
    assert message.startswith(f"plan field {field}:") and "\n" not in message, message


def test_ep_must_divide_the_experts():
    from megatron_auto.plan import PlanError
    config = make_config(num_experts=6, layer_freq=2)
    with pytest.raises(PlanError, match=r"^plan field layers\[0\]\.ep=4: must divide "
                                        r"--num-experts=6"):
        _plan_with(ep=4).validate(config)
    _plan_with(ep=2).validate(config)  # 6 experts over 2 ranks: fine


def test_expert_weights_are_split_on_two_dims_inside_the_ep_chunk():
    """The shard description the init, gathering and checkpoints read: an ep 2 x expert_tp 2
    expert weight is EP chunk ``ep_rank`` of dim 0, then expert-TP chunk of dim 1 (fc1) / 2
    (fc2); the local shapes are the global ones divided accordingly."""
    from megatron_auto.models.init import collect_shard_specs, global_shape, shard_tensor
    from megatron_auto.parallel.context import ExpertGroups

    config = make_config(layer_freq=2, activation="swiglu")
    groups = ExpertGroups(layout=None, ep_group="ep", ep_rank=1, ep_size=2, ep_ranks=(0, 1),
                          dp=None, expert_tp_group="etp", expert_tp_rank=1, expert_tp_size=2,
                          expert_tp_ranks=(0, 1))
    one = one_rank_groups()
    block = MoELayer(config, one, expert_groups=groups)
    specs = collect_shard_specs(block)
    e, f, h = config.moe.num_experts, config.expert_ffn_hidden_size, config.hidden_size
    fc1, fc2 = specs["experts.linear_fc1.weight"], specs["experts.linear_fc2.weight"]
    assert (fc1.dim, fc1.tp_size, fc1.tp_rank, fc1.tp_group) == (0, 2, 1, "ep")
    assert (fc1.inner.dim, fc1.inner.tp_size, fc1.inner.tp_rank) == (1, 2, 1)
    assert (fc2.dim, fc2.inner.dim, fc2.inner.tp_group) == (0, 2, "etp")
    assert tuple(block.experts.linear_fc1.weight.shape) == (e // 2, 2 * f // 2, h)
    assert tuple(block.experts.linear_fc2.weight.shape) == (e // 2, h, f // 2)
    assert global_shape(block.experts.linear_fc1.weight.shape, fc1) == [e, 2 * f, h]
    full = torch.arange(e * 2 * f * h, dtype=torch.float32).view(e, 2 * f, h)
    # experts 2..3 (EP rank 1), rows f..2f-1 (expert-TP rank 1): whole (gate, up) pairs
    assert torch.equal(shard_tensor(full, fc1), full[e // 2:, f:, :])
