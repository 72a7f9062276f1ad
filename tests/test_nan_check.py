"""--check-for-nan-in-loss-and-grad: a non-finite loss or gradient stops the run with one line
naming the iteration, the rank and which it was; an fp16 overflow stays a skipped step."""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from harness import layer, plan_of, run_main
from test_equivalence import CONFIG, make_batch

pytestmark = pytest.mark.multirank

TINY_RUN = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "16", "--vocab-size", "128", "--train-iters", "6",
            "--log-interval", "1", "--eval-iters", "0", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--clip-grad", "0"]


def test_exploding_run_stops_naming_iteration_rank_and_loss():
    # Adam's first step moves every weight by about --lr: at 1e30 the second forward overflows.
    # Two pipeline stages: only rank 1 (the last stage) computes a loss, so the rank is told.
    argv = TINY_RUN + ["--lr", "1e30", "--pipeline-model-parallel-size", "2",
                       "--check-for-nan-in-loss-and-grad"]
    (code0, err0), (code1, err1) = run_main("pretrain_gpt", 2, argv, capture="stderr")
    assert (code0, code1) == (2, 2)
    lines = err0.strip().splitlines()
    assert lines == ["error: --check-for-nan-in-loss-and-grad: iteration 2: loss is not finite "
                     "(inf/nan) on rank 1; lower --lr, or check the data and the model"]
    assert err1 == ""  # one line, from rank 0


def test_without_the_flag_the_exploding_run_goes_on():
    (code, err), = run_main("pretrain_gpt", 1, TINY_RUN + ["--lr", "1e30", "--train-iters", "3"],
                            capture="stderr")
    assert code == 0 and "error" not in err


def _hooked_worker(rank, world_size, precision, steps):
    """A one-rank trainer whose first parameter's gradient is made nan on every backward."""
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.plan import Plan
    from megatron_auto.run_config import PrecisionConfig
    from megatron_auto.training.trainer import NonFiniteError, build_trainer, train_step

    trainer = build_trainer(CONFIG, Plan.from_dict(plan_of(1, [layer()] * 4, num_microbatches=1)),
                            lambda cfg, ctx, seed: GPTStage(cfg, ctx, seed=seed),
                            precision=PrecisionConfig(**precision), check_for_nan=True)
    param = next(p for p in trainer.stage.parameters() if p.requires_grad)
    param.register_hook(lambda grad: grad * float("nan"))
    results = []
    try:
        for step in range(steps):
            results.append(train_step(trainer, make_batch(step)).skipped)
    except NonFiniteError as err:
        return str(err), results
    return None, results


def test_nan_gradient_stops_naming_the_grad_norm():
    (message, results), = run_distributed(_hooked_worker, 1, {}, 2)
    assert results == []  # raised before the first optimizer step
    assert message == ("--check-for-nan-in-loss-and-grad: iteration 1: grad norm is not finite "
                       "(inf/nan) on rank 0; lower --lr, or check the data and the model")


def test_fp16_non_finite_gradients_stay_skipped_steps():
    (message, skipped), = run_distributed(_hooked_worker, 1, {"fp16": True}, 2)
    assert message is None and skipped == [True, True]
