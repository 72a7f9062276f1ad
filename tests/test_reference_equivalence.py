"""Parallel plans on 4 and 8 ranks against the independent plain-PyTorch reference.

The reference (``tests/reference/``) is written from the architectures' definitions and imports
nothing of megatron_auto; this module is the only place that knows both sides. Three models:

- ``gpt2``: learned positions, LayerNorm, GELU (erf), multi-head attention, tied head, biases;
- ``llama``: RoPE, RMSNorm, SwiGLU, grouped-query attention (4 heads, 2 key/value groups),
  untied head, no biases;
- ``bert``: bidirectional layers under a padding mask, token types, MLM + sentence-order heads.

Initial weights: the reference draws them by its own rule (``reference.models.initial_weights``:
each tensor from the CRC-32 of its reference name, no global seed), and
``reference.package_layout.to_package`` writes them into the package's documented global
layouts (fused, grouped QKV rows; SwiGLU's interleaved gate/up rows), which every rank cuts into
its shards with the stage's own shard specs before data parallelism wraps it. The weights are
an input to both sides, so sharing them cannot hide a mistake in what either side computes from
them; a wrong layout in ``to_package`` or in the package's use of its layout fails the test
rather than passing it.
(What this bypasses is the package's plan-independent initialisation, which
``test_equivalence.py`` checks.) The rule makes every parameter matter from the first step:
norm weights ``1 + N(0, 0.2^2)``, biases ``N(0, 0.1^2)``, matrices ``N(0, 1/fan_in)``, so the
attention logits and the output logits are O(1) and no sub-layer sits in a linear,
insensitive regime. (Measured on the gpt2 reference alone, 4 steps: with Megatron's init, std
0.02, norm weights 1 and biases 0, a 10% attention-scale error moves the losses by at most
1.1e-7 and the grad norms by 8.9e-7, invisible at any sane tolerance; with this rule by 1.9e-3
and 2.4e-2.) The norm epsilon is 0.05, large against the normalised variance (~1), so that it is
felt. Both sides train 4 steps of AdamW (lr 1e-2, weight decay 0.1 on matrices, eps 1e-6) with
the global gradient clipped at 1.0 on the same global batches of 8 sequences.

Compared per step: the loss and the gradient norm before clipping, both at relative
``RTOL = 1e-5``. Measured without a mutation: at most 3.1e-7 (losses) and 2.0e-6 (grad norms,
the llama plans; the gpt2 and bert plans stay under 3.1e-7) over every plan here.

Mutation checks (``python tests/mutation_check.py --baseline``: each bug planted in a copy of the
repository, this module run there; largest relative deviation over the plans of a loss and of
a grad norm, against the 1e-5 tolerance). Every one fails the test:

======================  ==================================================  =======  =========
mutation                what changes (file)                                 loss     grad norm
======================  ==================================================  =======  =========
attn-scale              softmax scale x0.99 (models/transformer.py)         1.8e-3   1.9e-2
attn-out                attention output x0.99                              1.4e-3   2.3e-2
mlp-out                 MLP output x0.99                                    1.9e-3   1.2e-2
norm-eps                LayerNorm epsilon x1.01                             4.3e-4   5.0e-3
rmsnorm-eps             RMSNorm epsilon x1.01                               6.7e-4   1.8e-3
rope-base               RoPE base x1.01                                     1.3e-4   2.5e-3
swiglu-gate             SwiGLU gate and up swapped                          1.9e-2   3.0e-1
gqa-mapping             query head j reads key/value head j % g             5.0e-2   2.0e-1
gelu-tanh               GELU's tanh approximation instead of erf            4.3e-5   4.4e-4
column-bias-tp1         column-parallel bias dropped at tp 1                8.9e-3   4.7e-2
                        (parallel/tensor_parallel.py)
row-bias-tp             row-parallel bias dropped at tp > 1 without SP      2.2e-2   1.4e-1
position-embedding      learned positions x0.99 (models/gpt.py)             6.5e-4   4.9e-3
tied-logits             tied LM-head logits x0.99                           2.3e-3   1.6e-2
mlm-bias                BERT MLM output bias dropped (models/bert.py)       8.5e-3   3.3e-2
pooler-tanh             BERT pooler without tanh                            6.5e-2   9.5e-1
======================  ==================================================  =======  =========

(The bias mutations fail only the plans that have such a layer: column-bias-tp1 2 of 5 gpt2/bert
plans, row-bias-tp 4 of 5; the others fail every plan of the models they touch.)
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from harness import Job, Recipe, plan_of, run_jobs
from mutation_check import report
from megatron_auto.config import ModelConfig
from megatron_auto.plan import LayerStrategy
from reference.models import Transformer, initial_weights
from reference.package_layout import ref_config, to_package
from reference.train import RefOptim, train

pytestmark = pytest.mark.multirank

GLOBAL_BATCH = 8
STEPS = 4
RTOL = 1e-5  # the equivalence invariant's bound (docs/design.md §4)
OPTIM = RefOptim(lr=1e-2, weight_decay=0.1, eps=1e-6, clip_grad=1.0)
_SHAPE = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
              vocab_size=60, make_vocab_size_divisible_by=16, hidden_dropout=0.0,
              attention_dropout=0.0, layernorm_epsilon=0.05)
MODELS = {
    "gpt2": ModelConfig(num_layers=4, **_SHAPE),
    "llama": ModelConfig(num_layers=4, position_embedding_type="rope", normalization="rmsnorm",
                         activation="swiglu", num_query_groups=2, add_bias_linear=False,
                         untie_embeddings_and_output_weights=True, **_SHAPE),
    "bert": ModelConfig(num_layers=2, model_type="bert", num_tokentypes=2, bert_binary_head=True,
                        **_SHAPE),
}


# ----------------------------------------------------------------------------------- batches
def gpt_batch(step: int, config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, config.seq_length + 1),
                           generator=gen)
    loss_mask = (torch.rand(GLOBAL_BATCH, config.seq_length, generator=gen) > 0.2).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask}


def bert_batch(step: int, config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    b, s = GLOBAL_BATCH, config.seq_length
    lengths = torch.randint(s // 2, s + 1, (b,), generator=gen)
    padding = (torch.arange(s)[None, :] < lengths[:, None]).long()
    loss_mask = ((torch.rand(b, s, generator=gen) < 0.3).long() * padding).float()
    loss_mask[:, 1] = 1.0  # at least one prediction per sample
    labels = torch.where(loss_mask > 0, torch.randint(0, config.vocab_size, (b, s), generator=gen),
                         torch.full((b, s), -1))
    return {"tokens": torch.randint(0, config.vocab_size, (b, s), generator=gen),
            "types": (torch.arange(s)[None, :] >= lengths[:, None] // 2).long() * padding,
            "padding_mask": padding, "labels": labels, "loss_mask": loss_mask,
            "is_random": torch.randint(0, 2, (b,), generator=gen),
            # what pretrain_bert.batch_fn adds: masked tokens per sample of the global batch
            "sop_weight": loss_mask.sum() / b}


def batch(model: str, step: int) -> dict[str, torch.Tensor]:
    return (bert_batch if model == "bert" else gpt_batch)(step, MODELS[model])


def batches(model: str) -> list[dict[str, torch.Tensor]]:
    return [batch(model, step) for step in range(STEPS)]


# ---------------------------------------------------------------------------------- the sides
@functools.lru_cache(maxsize=None)
def reference_run(model: str) -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    """(initial weights in the package's layout, per-step (loss, grad norm)) of the reference."""
    torch.manual_seed(0)  # nothing random is drawn; fixed anyway
    net = Transformer(ref_config(MODELS[model]))
    weights = to_package(initial_weights(net), MODELS[model])
    if model == "bert":
        def loss_fn(m, b):
            return m.bert_loss(b["tokens"], b["types"], b["padding_mask"], b["labels"],
                               b["loss_mask"], b["is_random"])
    else:
        def loss_fn(m, b):
            return m.gpt_loss(b["tokens"], b["labels"], b["loss_mask"])
    return weights, train(net, loss_fn, batches(model), OPTIM)


def _load_weights(model: str, weights: dict[str, torch.Tensor], cfg: ModelConfig, ctx: Any,
                  seed: int) -> torch.nn.Module:
    """The package's stage of ``model`` holding the reference's initial ``weights`` (this
    rank's shards); a parameter the reference lacks is a ``KeyError``."""
    from megatron_auto.models.bert import BertStage
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.models.init import shard_tensor

    stage = (BertStage if model == "bert" else GPTStage)(cfg, ctx, seed=seed)
    with torch.no_grad():
        for fqn, param in stage.named_parameters():
            param.copy_(shard_tensor(weights[fqn], stage.shard_specs.get(fqn)))
    return stage


def recipe(model: str) -> Recipe:
    """The harness's recipe for the package's side: the reference's initial weights, batches
    and optimizer settings (AdamW, constant LR), the model's task."""
    from megatron_auto.run_config import LRConfig, OptimizerConfig
    from megatron_auto.training.trainer import GPT_TASK
    from pretrain_bert import BERT_TASK

    weights = reference_run(model)[0]
    return Recipe(
        MODELS[model], functools.partial(_load_weights, model, weights),
        functools.partial(batch, model),
        optimizer=OptimizerConfig(weight_decay=OPTIM.weight_decay, adam_beta1=OPTIM.betas[0],
                                  adam_beta2=OPTIM.betas[1], adam_eps=OPTIM.eps,
                                  clip_grad=OPTIM.clip_grad),
        lr=LRConfig(lr=OPTIM.lr, decay_style="constant"), seed=1,
        task=BERT_TASK if model == "bert" else GPT_TASK)


def max_deviation(got: list[tuple[float, float]], want: list[tuple[float, float]]
                  ) -> tuple[float, float]:
    """Largest relative difference of the losses and of the grad norms over the steps."""
    loss = max(abs(g[0] - w[0]) / abs(w[0]) for g, w in zip(got, want))
    norm = max(abs(g[1] - w[1]) / abs(w[1]) for g, w in zip(got, want))
    return loss, norm


# ------------------------------------------------------------------------------------ the plans
def _plan(world_size: int, layers: list[LayerStrategy], *, stages=None, **kwargs: Any) -> dict:
    """The harness's plan dict for this module's global batch (``stages``: the chunks)."""
    return plan_of(world_size, layers, layers_per_stage=stages, global_batch_size=GLOBAL_BATCH,
                   **kwargs)


L = LayerStrategy
PLANS: dict[int, dict[str, tuple[str, dict]]] = {
    4: {
        "gpt2 tp2-sp zero1 x dp2": ("gpt2", _plan(4, [
            L(tp=2, dp_mode="zero1", sequence_parallel=True)] * 4, vocab_tp=2)),
        "gpt2 pp2 interleaved v2, zero3/ddp, tied across stages": ("gpt2", _plan(4, [
            L(dp_mode="zero3"), L(tp=2, tp_consecutive=False), L(dp_mode="zero2"),
            L(tp=2, recompute=True)], stages=(1, 1, 1, 1), virtual_size=2, num_microbatches=4)),
        "llama tp2 x dp2, vocab tp4": ("llama", _plan(4, [
            L(tp=2, sequence_parallel=True), L(tp=2, dp_mode="zero2"), L(tp=1, dp_mode="zero3"),
            L(tp=2, tp_consecutive=False)], vocab_tp=4)),
        "llama pp4 gpipe": ("llama", _plan(4, [L()] * 4, stages=(1, 1, 1, 1),
                                            schedule="gpipe", num_microbatches=4)),
        "bert tp2 pp2": ("bert", _plan(4, [L(tp=2), L(tp=2, dp_mode="zero3")],
                                       stages=(1, 1), vocab_tp=2)),
    },
    8: {
        "gpt2 pp2 x (tp2 x dp2) mixed": ("gpt2", _plan(8, [
            L(tp=4), L(tp=1, dp_mode="zero2"), L(tp=2, tp_consecutive=False, recompute=True),
            L(tp=2, dp_mode="zero3", sequence_parallel=True)], stages=(2, 2), vocab_tp=2,
            vocab_dp_mode="zero1")),
        "llama pp2 tp2 x dp2": ("llama", _plan(8, [
            L(tp=2, dp_mode="zero1"), L(tp=2, sequence_parallel=True), L(tp=1), L(tp=2)],
            stages=(2, 2), num_microbatches=2, vocab_tp=2)),
        "bert tp2 x dp4": ("bert", _plan(8, [L(tp=2, dp_mode="zero1"), L(tp=4)],
                                         vocab_tp=2, vocab_dp_mode="zero3")),
    },
}


@functools.lru_cache(maxsize=None)
def parallel_runs(world_size: int) -> dict[str, dict]:
    """Every plan of ``world_size`` ranks (all models, one forked run): per step (loss, grad
    norm), the parameter names the ranks hold, the names of the reference's weights."""
    names = list(PLANS[world_size])
    jobs = [Job(recipe(PLANS[world_size][n][0]), PLANS[world_size][n][1], 0, STEPS)
            for n in names]
    results = {}
    for name, job, trained in zip(names, jobs, run_jobs(world_size, jobs)):
        model = PLANS[world_size][name][0]
        results[name] = {"steps": [(r["lm_loss"], r["grad_norm"]) for r in trained.results],
                         "loaded": set(trained.state), "weights": set(reference_run(model)[0])}
    return results


CASES = [(w, n) for w in PLANS for n in PLANS[w]]


@pytest.mark.parametrize("world_size,name", CASES, ids=[f"{w}ranks-{n}" for w, n in CASES])
def test_plan_matches_independent_reference(world_size: int, name: str) -> None:
    model = PLANS[world_size][name][0]
    run = parallel_runs(world_size)[name]
    # every parameter a rank holds was loaded from the reference (another is a KeyError), and
    # together the ranks hold every weight of the reference
    assert run["loaded"] == run["weights"], (run["loaded"] ^ run["weights"])
    want = reference_run(model)[1]
    got = run["steps"]
    loss_dev, norm_dev = max_deviation(got, want)
    report(test="reference", plan=f"{world_size} ranks {name}", loss=loss_dev,
           grad_norm=norm_dev)  # read by tests/mutation_check.py
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=RTOL), (
        f"{name}: losses {got} vs reference {want}")
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], rel=RTOL), (
        f"{name}: grad norms {got} vs reference {want}")


def test_reference_training_is_not_degenerate() -> None:
    """The comparison means something only if the losses move and clipping is exercised."""
    for model in MODELS:
        steps = reference_run(model)[1]
        losses = [loss for loss, _ in steps]
        assert max(losses) - min(losses) > 1e-2 * losses[0], (model, steps)
        assert any(norm > OPTIM.clip_grad for _, norm in steps), (model, steps)
