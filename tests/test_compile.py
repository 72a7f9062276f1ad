"""``--compile``: compiled transformer layers train the same numbers as eager ones (fp32).

Tolerance: the same rtol=1e-5 / atol=1e-7 as the eager equivalence tests. aot_eager runs the
captured forward and backward graphs with eager kernels, so only summation order could differ;
inductor generates new kernels (fused reductions), hence its looser rtol=1e-4.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from dist_utils import run_distributed
from harness import metrics_records, run_main
from megatron_auto.models.compile import (CompileError, compile_layers,
                                          inductor_unavailable_reason, resolve_backend)
from test_gpt_model import CONFIG, make_batch, plan_of


def _step(rank, world_size, backend, layers, config=CONFIG):
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.parallel.context import ParallelContext

    plan = plan_of(world_size, layers, vocab_tp=world_size)
    stage = GPTStage(config, ParallelContext(plan), seed=3)
    compiled = compile_layers(stage.layers.values(), backend, torch.device("cpu")) if backend else 0
    batch = make_batch(config)
    loss, _ = stage(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in stage.named_parameters()
             if p.grad is not None}
    return compiled, loss.detach(), grads, sorted(n for n, _ in stage.named_parameters())


# TP 2 next to TP 1 (a relayout between compiled layers) with recompute on one layer.
MIXED = [(2, True, False), (1, True, True), (2, True, False), (1, True, False)]


@pytest.mark.multirank
def test_aot_eager_layers_match_eager_under_tp_and_recompute():
    eager = run_distributed(_step, 2, None, MIXED)
    compiled = run_distributed(_step, 2, "aot_eager", MIXED)
    for (n_ref, loss_ref, grads_ref, names_ref), (n, loss, grads, names) in zip(eager, compiled):
        assert n_ref == 0 and n == len(MIXED)
        assert names == names_ref  # in-place compile keeps the plan-independent names
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-7)
        assert grads.keys() == grads_ref.keys()
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-7,
                                       msg=name)


@pytest.mark.multirank
@pytest.mark.skipif(inductor_unavailable_reason(torch.device("cpu")) is not None,
                    reason=f"inductor cannot build CPU kernels here: "
                           f"{inductor_unavailable_reason(torch.device('cpu'))}")
def test_inductor_layer_matches_eager():
    one_layer = dataclasses.replace(CONFIG, num_layers=1)  # one kernel build keeps it short
    layers = [(1, True, False)]
    [(_, loss_ref, grads_ref, _)] = run_distributed(_step, 1, None, layers, one_layer)
    [(n, loss, grads, _)] = run_distributed(_step, 1, "inductor", layers, one_layer)
    assert n == 1
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-6)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.single
def test_unknown_backend_is_named():
    with pytest.raises(CompileError, match="--compile-backend=tvm: unknown; choose one of "
                                           "inductor, aot_eager, eager"):
        resolve_backend("tvm", torch.device("cpu"))


@pytest.mark.single
def test_inductor_without_a_compiler_warns_once_and_stays_eager(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr("shutil.which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert compile_layers([torch.nn.Linear(2, 2)], "inductor", torch.device("cpu")) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "needs a C++ compiler" in warnings[0]


@pytest.mark.multirank
def test_compile_flag_trains_the_eager_losses_with_zero3_tp_and_recompute(tmp_path):
    from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy

    plan = Plan(world_size=2, global_batch_size=4, num_microbatches=2,
                pipeline=PipelineSpec(1, "1f1b", (2,)), vocab=VocabStrategy(tp=2),
                layers=(LayerStrategy(tp=2, recompute=True), LayerStrategy(tp=1, dp_mode="zero3")))
    plan.save(tmp_path / "plan.json")
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "--compile-backend",
                                                      "aot_eager"])):
        metrics = tmp_path / f"{name}.jsonl"
        argv = ["--mock-data", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128",
                "--train-iters", "3", "--log-interval", "1", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--eval-iters", "0", "--plan",
                str(tmp_path / "plan.json"), "--metrics-file", str(metrics), *extra]
        assert run_main("pretrain_gpt", 2, argv) == [0, 0]
        losses[name] = [r["lm_loss"] for r in metrics_records(metrics)]
    assert len(losses["eager"]) == 3
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]),
                               rtol=1e-5, atol=0)


@pytest.mark.single
def test_unknown_compile_backend_flag_is_one_error_line(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(["--mock-data", "--compile", "--compile-backend", "tvm"]) == 2
    assert ("error: --compile-backend=tvm: unknown; choose one of inductor, aot_eager, eager"
            in capsys.readouterr().err)
