"""Per-layer DDP / ZeRO-2 / ZeRO-3 against one process (gloo ranks forked from pytest).

Stand-in model: every "layer" is a small tensor-parallel MLP (norm weight -> column-parallel ->
tanh -> row-parallel, built from the real TP layers) that reads its own data-parallel chunk of
each micro-batch and adds its own squared-error loss; the "embedding" looks tokens up and scores
them with the same (tied) table through ``embed``/``logits`` methods. Layers are independent, so
the test isolates what data parallelism must get right: which samples each replica saw and how
gradients are summed, sharded, clipped and kept tied. The reference is the same model with full
weights in one process. fp32, tolerances: rel 1e-5 (the equivalence invariant, docs/design.md §4).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_utils import run_distributed
from megatron_auto.parallel.context import ParallelContext
from megatron_auto.parallel.data_parallel import DataParallel, local_tensor
from megatron_auto.parallel.ddp_buckets import GradBuckets
from megatron_auto.parallel.mappings import copy_to_tensor_parallel
from megatron_auto.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                    VocabParallelEmbedding,
                                                    vocab_parallel_cross_entropy)
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy

pytestmark = pytest.mark.multirank

D, F_HID, VOCAB, SEQ = 8, 16, 32, 3
TOL = dict(rtol=1e-5, atol=1e-6)


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def _shard(t: torch.Tensor, dim: int, groups) -> torch.Tensor:
    return t.chunk(groups.tp_size if groups else 1, dim)[groups.tp_rank if groups else 0].clone()


class Block(nn.Module):
    """norm weight (TP-replicated) -> column-parallel -> tanh -> row-parallel (bias replicated)."""

    def __init__(self, index: int, groups) -> None:
        super().__init__()
        self.groups = groups
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(1.0 + _full(100 + index, D))
        one = groups is None
        g = groups if not one else _Solo()
        self.fc1 = ColumnParallelLinear(D, F_HID, g)
        self.fc2 = RowParallelLinear(F_HID, D, g)
        with torch.no_grad():
            self.fc1.weight.copy_(_shard(_full(200 + index, F_HID, D), 0, groups))
            self.fc1.bias.copy_(_shard(_full(300 + index, F_HID), 0, groups))
            self.fc2.weight.copy_(_shard(_full(400 + index, D, F_HID), 1, groups))
            self.fc2.bias.copy_(_full(500 + index, D))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.tanh(self.fc1(x * self.norm.weight)))
        return ((y - target) ** 2).sum()


class _Solo:
    tp_group, tp_size, tp_rank = None, 1, 0


class Embedding(nn.Module):
    """Word embedding with the tied LM head as methods (what FSDP2 must register)."""

    def __init__(self, groups) -> None:
        super().__init__()
        self.groups = groups
        self.word_embeddings = VocabParallelEmbedding(VOCAB, D, groups or _Solo())
        with torch.no_grad():
            self.word_embeddings.weight.copy_(_shard(_full(7, VOCAB, D), 0, groups))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        tp_group = self.groups.tp_group if self.groups else None
        if tp_group is not None and self.groups.tp_size > 1:
            hidden = copy_to_tensor_parallel(hidden, tp_group)
        return F.linear(hidden, self.word_embeddings.weight)


class StandIn(nn.Module):
    """The layers of one stage (and the embedding on the first/last stage) of a plan.

    ``ctx=None`` builds the single-process reference with every layer and full weights. A stage
    uses the embedding's ``embed`` on the first stage and ``logits`` on the last one.
    """

    def __init__(self, plan: Plan, ctx: ParallelContext | None) -> None:
        super().__init__()
        stages = range(plan.pp_size) if ctx is None else [ctx.stage]
        self.uses = set()
        layer_ids = [i for k in stages for i in plan.stage_layer_range(k)]
        self.layers = nn.ModuleDict({str(i): Block(i, ctx.layer_groups(i) if ctx else None)
                                     for i in layer_ids})
        if 0 in stages:
            self.uses.add("embed")
        if plan.pp_size - 1 in stages:
            self.uses.add("logits")
        self.embedding = Embedding(ctx.vocab_groups() if ctx else None)
        self.ctx = ctx

    def parallel_units(self) -> list:
        """The mapping DataParallel reads: the embedding first where its ``embed`` runs (the
        first stage: its gradient is complete only at the end), else after the layers."""
        layers = [(f"layers.{key}", block, int(key)) for key, block in self.layers.items()]
        embedding = [("embedding", self.embedding, None)]
        return embedding + layers if "embed" in self.uses else layers + embedding

    def _chunk(self, t: torch.Tensor, groups) -> torch.Tensor:
        return t if groups is None else t.chunk(groups.dp_size)[groups.dp_rank]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = torch.zeros(())
        for key, block in self.layers.items():
            g = self.ctx.layer_groups(int(key)) if self.ctx else None
            loss = loss + block(self._chunk(batch["x"], g), self._chunk(batch["y"], g))
        g = self.ctx.vocab_groups() if self.ctx else None
        tokens = self._chunk(batch["tokens"], g)
        if "embed" in self.uses:  # a smooth function of the looked-up rows
            loss = loss + (self.embedding.embed(tokens) ** 2).sum() * 0.5
        if "logits" in self.uses:  # cross entropy of the tied head on fixed features
            logits = self.embedding.logits(self._chunk(batch["h"], g))
            loss = loss + vocab_parallel_cross_entropy(logits, tokens, g).sum()
        return loss


def _batches(num: int, size: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(42)
    return [{"x": torch.randn(size, D, generator=gen), "y": torch.randn(size, D, generator=gen),
             "tokens": torch.randint(0, VOCAB, (size, SEQ), generator=gen),
             "h": torch.randn(size, SEQ, D, generator=gen)} for _ in range(num)]


def _train_step(model: nn.Module, dp: DataParallel | None, batches, scale: float) -> None:
    for m, batch in enumerate(batches):
        if dp is not None:
            dp.set_microbatch(m, len(batches))
        (model(batch) / scale).backward()
    if dp is not None:
        dp.finish_grad_sync()


def _global_views(model: StandIn, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Each local parameter (ZeRO shards gathered over DP) by FQN; TP shards stay shards."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
    return out


def _tp_shard_of(ref: StandIn, name: str, ctx: ParallelContext) -> torch.Tensor:
    """The reference parameter cut the way this rank's TP layout cuts ``name``."""
    full = dict(ref.named_parameters())[name].detach()
    parts = name.split(".")
    groups = ctx.layer_groups(int(parts[1])) if parts[0] == "layers" else ctx.vocab_groups()
    dims = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "word_embeddings.weight": 0}
    dim = dims.get(".".join(parts[-2:]))
    return full if dim is None else _shard(full, dim, groups)


def _equivalence(rank, world_size, plan_dict, clips):
    plan = Plan.from_dict(plan_dict)
    ctx = ParallelContext(plan, device=torch.device("cpu"))
    model, ref = StandIn(plan, ctx), StandIn(plan, None)
    dp = DataParallel(model, ctx, bucket_size_bytes=600)  # several buckets per group
    opt = torch.optim.SGD(dp.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    mb = plan.microbatch_size
    norms = []
    for clip in clips:
        batches = _batches(plan.num_microbatches, mb)
        scale = float(plan.global_batch_size)
        dp.zero_grad()
        ref_opt.zero_grad()
        _train_step(model, dp, batches, scale)
        _train_step(ref, None, batches, scale)
        norm = dp.clip_grad_norm_(clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else math.inf)
        norms.append((norm, ref_norm.item()))
        opt.step()
        ref_opt.step()
    mine = _global_views(model, ctx)
    for name, value in mine.items():
        torch.testing.assert_close(value, _tp_shard_of(ref, name, ctx), **TOL, msg=name)
    resident = {row["unit"]: row for row in dp.describe()}
    resident["buckets"] = (dp.num_buckets, dp.last_num_overlapped)
    return norms, resident, sorted(mine)


def _plan(layers, vocab=("zero3", 2), world=4, pp=1, lps=None, gbs=8, mbs=2) -> dict:
    return Plan(world_size=world, global_batch_size=gbs, num_microbatches=mbs,
                pipeline=PipelineSpec(size=pp, layers_per_stage=tuple(lps or [len(layers)])),
                vocab=VocabStrategy(tp=vocab[1], dp_mode=vocab[0]),
                layers=tuple(LayerStrategy(tp=t, dp_mode=m, tp_consecutive=c,
                                           recompute="rc" in r)  # optional 4th item "rc"
                             for t, m, c, *r in layers)).to_dict()


MIXED = [(1, "ddp", True), (1, "zero2", True), (1, "zero3", True), (2, "ddp", True),
         (2, "zero2", False), (2, "zero3", True), (4, "zero3", True)]


def test_mixed_modes_match_one_process():
    # Step 1 unclipped, step 2 clipped to 0.05 (far below the norm, so the clip is active).
    results = run_distributed(_equivalence, 4, _plan(MIXED), (0.0, 0.05))
    for norms, resident, _ in results:
        for norm, ref_norm in norms:
            assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert norms[1][1] > 10 * 0.05
        num_buckets, overlapped = resident["buckets"]
        # every bucket but the one completed by the step's last gradient started inside backward
        assert num_buckets >= 3 and overlapped == num_buckets - 1
        # tp=4 leaves one replica: nothing to shard, the layer behaves like ddp.
        assert resident["layers.6"]["dp_mode"] == "ddp"
    # ZeRO-3 over 4 ranks: each holds a quarter of layer 2 (fc1 (16,8) splits evenly).
    full = Block(2, None)
    full_numel = sum(p.numel() for p in full.parameters())
    local = [r[1]["layers.2"]["local_numel"] for r in results]
    assert sum(local) == full_numel
    assert max(local) <= full_numel / 4 + 2 * D  # dim-0 padding of the small tensors


def test_pipeline_stages_hold_their_layers_and_keep_tied_embedding():
    plan = _plan([(1, "ddp", True), (2, "zero3", True), (1, "zero2", True)],
                 vocab=("ddp", 1), pp=2, lps=[2, 1])
    results = run_distributed(_equivalence, 4, plan, (0.0, 0.0))
    for rank, (norms, _, names) in enumerate(results):
        layers = {n.split(".")[1] for n in names if n.startswith("layers.")}
        assert layers == ({"0", "1"} if rank < 2 else {"2"})
        assert "embedding.word_embeddings.weight" in names
        for norm, ref_norm in norms:
            assert norm == pytest.approx(ref_norm, rel=1e-5)


def _bf16(rank, world_size, plan_dict):
    plan = Plan.from_dict(plan_dict)
    ctx = ParallelContext(plan, device=torch.device("cpu"))
    model = StandIn(plan, ctx)
    dp = DataParallel(model, ctx, precision="bf16")
    opt = torch.optim.AdamW(dp.parameters(), lr=0.05)
    batches = _batches(plan.num_microbatches, plan.microbatch_size)  # the same batch each step
    losses = []
    for _ in range(4):
        dp.zero_grad()
        total = 0.0
        for m, batch in enumerate(batches):
            dp.set_microbatch(m, len(batches))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch) / plan.global_batch_size
            loss.backward()
            total += loss.item()
        dp.finish_grad_sync()
        norm = dp.clip_grad_norm_(1.0)
        opt.step()
        losses.append(total)
        assert math.isfinite(norm)
    for p in dp.parameters():
        assert local_tensor(p).dtype == torch.float32  # master weights stay fp32
    t = torch.tensor(losses)
    dist.all_reduce(t)
    return t.tolist()


def test_bf16_trains():
    plan = _plan([(1, "ddp", True), (1, "zero2", True), (2, "zero3", True)],
                 vocab=("zero3", 1), world=2)
    losses = run_distributed(_bf16, 2, plan)[0]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0]


def _bad_input(rank, world_size):
    plan = Plan.from_dict(_plan([(1, "ddp", True)], vocab=("ddp", 1), world=2))
    ctx = ParallelContext(plan, device=torch.device("cpu"))
    model = StandIn(plan, ctx)
    loose = nn.Module()
    loose.scale = nn.Parameter(torch.ones(2))  # no layer or embedding to give it a group
    loose.parallel_units = lambda: []
    misnamed = StandIn(plan, ctx)
    misnamed.parallel_units = lambda: [("layer.0", misnamed.layers["0"], 0)]
    errors = []
    for call in (lambda: DataParallel(model, ctx, precision="fp8"),
                 lambda: DataParallel(model, ctx).set_microbatch(2, 2),
                 lambda: GradBuckets([], bucket_size_bytes=0),
                 lambda: DataParallel(loose, ctx),
                 lambda: DataParallel(nn.Linear(2, 2), ctx),
                 lambda: DataParallel(misnamed, ctx)):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    # A gradient arriving after its bucket was sent (a second backward without set_microbatch
    # or finish) must fail loudly rather than be lost.
    w = nn.Parameter(torch.ones(3))
    buckets = GradBuckets([(dist.group.WORLD, [w])])
    (w * 2).sum().backward()
    try:
        (w * 3).sum().backward()
    except RuntimeError as err:
        errors.append(str(err))
    buckets.finish()
    errors.append(w.grad.tolist())  # the first backward, summed over both ranks
    return errors


def test_bad_input_names_the_field():
    errors = run_distributed(_bad_input, 2)[0]
    assert "precision='fp8'" in errors[0] and "bf16" in errors[0]
    assert "set_microbatch(index=2, num_microbatches=2)" in errors[1]
    assert "bucket_size_bytes=0" in errors[2]
    assert "parameters ['scale'] belong to no unit of Module.parallel_units()" in errors[3]
    assert "Linear has no parallel_units()" in errors[4]
    assert "names 'layer.0', which is not that module's FQN in the stage" in errors[5]
    assert "received a gradient after its bucket's all-reduce was launched" in errors[6]
    assert errors[7] == [4.0, 4.0, 4.0]


# ------------------------------------------------------------------ with the real GPTStage
GPT_CONFIG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  seq_length=8, vocab_size=100, make_vocab_size_divisible_by=32,
                  hidden_dropout=0.0, attention_dropout=0.0)
GPT_BATCH = 8


def _gpt_train(rank, world_size, plan_dict, steps):
    """``steps`` iterations of forward_backward + DP sync + clip + SGD; full params by FQN."""
    from megatron_auto.config import ModelConfig
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.models.init import gather_full_state
    from megatron_auto.parallel.pipeline import forward_backward

    plan = Plan.from_dict(plan_dict)
    config = ModelConfig(**GPT_CONFIG)
    ctx = ParallelContext(plan, device=torch.device("cpu"))
    stage = GPTStage(config, ctx, seed=42)
    dp = DataParallel(stage, ctx, bucket_size_bytes=4096)
    opt = torch.optim.SGD(dp.parameters(), lr=0.5, momentum=0.9)
    norms = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        s = config.seq_length
        tokens = torch.randint(0, config.vocab_size, (GPT_BATCH, s), generator=gen)
        labels = torch.randint(0, config.vocab_size, (GPT_BATCH, s), generator=gen)
        mask = (torch.rand(GPT_BATCH, s, generator=gen) > 0.2).float()
        mbs = plan.microbatch_size
        microbatches = [{"tokens": tokens[k:k + mbs], "labels": labels[k:k + mbs],
                         "loss_mask": mask[k:k + mbs]} for k in range(0, GPT_BATCH, mbs)]
        dp.zero_grad()
        forward_backward(stage, dp, ctx, microbatches, schedule=plan.pipeline.schedule,
                         total_tokens=mask.sum().item())
        norms.append(dp.clip_grad_norm_(0.5))
        opt.step()
    return {"norms": norms, "params": gather_full_state(stage, ctx), "stage": ctx.stage,
            "layers": sorted(stage.layers.keys(), key=int),
            "buckets": (dp.num_buckets, dp.last_num_overlapped)}


GPT_PLANS = {
    # one stage: all three modes, strided TP, recompute, a tp=4 layer with a single replica; the
    # tied vocab shares layer 1's DP group and buckets (its gradient is complete only at the end)
    "pp1": _plan([(1, "zero3", True), (2, "ddp", True), (2, "zero2", False),
                  (4, "ddp", True, "rc")],
                 vocab=("ddp", 2), gbs=GPT_BATCH, mbs=2),
    # two stages, 1F1B with 4 micro-batches, ZeRO-2 vocab shards tied across the stages,
    # recompute inside ZeRO-2 and ZeRO-3 layers
    "pp2": _plan([(1, "zero2", True, "rc"), (2, "ddp", True), (1, "ddp", True),
                  (1, "zero3", True, "rc")],
                 vocab=("zero2", 1), pp=2, lps=[2, 2], gbs=GPT_BATCH, mbs=4),
}


_GPT_REFERENCE: list[dict] = []


def _gpt_reference() -> dict:
    if not _GPT_REFERENCE:  # one process, one micro-batch: the model every plan must train
        one = _plan([(1, "ddp", True)] * 4, vocab=("ddp", 1), world=1, gbs=GPT_BATCH, mbs=1)
        _GPT_REFERENCE.append(run_distributed(_gpt_train, 1, one, 2)[0])
    return _GPT_REFERENCE[0]


@pytest.mark.parametrize("name", sorted(GPT_PLANS))
def test_gpt_stage_trains_like_one_process(name):
    ref = _gpt_reference()
    assert min(ref["norms"]) > 0.5  # so the clip to 0.5 is active in both steps
    results = run_distributed(_gpt_train, 4, GPT_PLANS[name], 2)
    seen = set()
    for r in results:
        for (norm, ref_norm) in zip(r["norms"], ref["norms"]):
            assert norm == pytest.approx(ref_norm, rel=1e-5)
        for fqn, value in r["params"].items():
            torch.testing.assert_close(value, ref["params"][fqn], rtol=1e-5, atol=1e-6, msg=fqn)
            seen.add(fqn)
        if name == "pp2":
            assert r["layers"] == (["0", "1"] if r["stage"] == 0 else ["2", "3"])
        else:  # buckets in backward order: only the one holding the embedding waits for the end
            num_buckets, overlapped = r["buckets"]
            assert num_buckets >= 3 and overlapped == num_buckets - 1
    assert seen == set(ref["params"])
