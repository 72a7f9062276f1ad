"""Plans on a world that is not a power of two train the same model as one process.

Six gloo ranks run tensor-parallel degrees 3 and 6 (heads, FFN and the padded vocabulary split
three and six ways), a 3-stage and a 2-stage pipeline of 3-rank stages, with the DP flavours and
a strided layout; losses, gradient norms and the gathered parameters after three AdamW steps
must match a one-process run of the same code within relative 1e-5 (the equivalence invariant
of test_equivalence.py, trained through the tests' harness with its GPT recipe).
"""

from __future__ import annotations

import pytest
import torch

from harness import layer, one_process_plan, plan_of, run_named, run_plans
from megatron_auto.config import ModelConfig
from test_equivalence import gpt_recipe

pytestmark = pytest.mark.multirank

# 6 heads, FFN 96 and a padded vocabulary of 60 divide by 2, 3 and 6.
CONFIG = ModelConfig(num_layers=4, hidden_size=48, num_attention_heads=6, ffn_hidden_size=96,
                     seq_length=16, vocab_size=60, make_vocab_size_divisible_by=12,
                     hidden_dropout=0.0, attention_dropout=0.0)
STEPS = 3
RTOL = 1e-5
# Parameters: atol 2e-6 where test_equivalence.py has 1e-6. Under tp 6 one weight of 4608
# (layers.0 fc2, value 7e-4) ends 1.3e-6 away: its gradient nearly cancels, so the six-way
# partial sums' fp32 rounding is a visible share of it and Adam's normalisation turns that into
# 0.13% of one lr step. Losses and gradient norms keep 1e-5 and 1e-4.
PARAM_ATOL = 2e-6

SIX_RANK_PLANS = {
    "tp3xdp2-mixed": plan_of(6, [layer(tp=3), layer(tp=3, dp_mode="zero2"),
                                 layer(tp=3, dp_mode="zero3", consecutive=False),
                                 layer(tp=6, recompute=True)], vocab_tp=3, vocab_dp_mode="zero1"),
    "tp6": plan_of(6, [layer(tp=6)] * 4, vocab_tp=6),
    "pp3-2+1+1": plan_of(6, [layer(tp=2), layer(tp=1, dp_mode="zero3"), layer(tp=2),
                             layer(tp=1, dp_mode="zero2")],
                         layers_per_stage=(2, 1, 1), num_microbatches=4, vocab_tp=2),
    "pp2-tp3-gpipe": plan_of(6, [layer(tp=3, recompute=True), layer(tp=3), layer(tp=3),
                                 layer(tp=3)],
                             layers_per_stage=(1, 3), num_microbatches=4, schedule="gpipe",
                             vocab_tp=3),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list, dict[str, torch.Tensor]]]:
    recipe = gpt_recipe(CONFIG)  # the harness checks replicas and tied copies agree
    trained = run_named(recipe, 6, SIX_RANK_PLANS, STEPS)
    (trained["one process"],) = run_plans(recipe, 1, [one_process_plan(CONFIG.num_layers)],
                                          STEPS)
    return {name: (t.results, t.state) for name, t in trained.items()}


@pytest.mark.parametrize("name", list(SIX_RANK_PLANS))
def test_six_rank_plan_matches_one_process(runs, name):
    results, state = runs[name]
    ref_results, ref_state = runs["one process"]
    assert [r["lm_loss"] for r in results] == pytest.approx(
        [r["lm_loss"] for r in ref_results], rel=RTOL), f"{name}: losses differ"
    assert [r["grad_norm"] for r in results] == pytest.approx(
        [r["grad_norm"] for r in ref_results], rel=1e-4), f"{name}: grad norms differ"
    assert set(state) == set(ref_state), f"{name}: parameter names differ"
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, k=key: f"{name}: {k}: {m}")
