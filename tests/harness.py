"""The multi-rank harness of the equivalence tests: train plans on forked gloo ranks, compare.

Every equivalence test trains one model family's tiny model under several plans and compares
each run with a one-process run (docs/design.md §4). What differs between families is a
:class:`Recipe`: the model config, the stage provider, the global batch of each step and the
optimizer settings; the rest is here, family-agnostic:

- :func:`run_plans` / :func:`run_phase` (and :func:`run_jobs`, for jobs of several recipes in
  one start-up) fork ``world_size`` gloo ranks (``dist_utils``), build a trainer per plan
  through ``build_trainer`` and ``train_step`` (the code the command line runs), optionally
  load or save a checkpoint, and return per plan a :class:`Trained`: rank 0's
  per-step results, the full parameters merged over ranks (replicas and tied copies checked
  against each other), the plan trained (a searched one included).
- :func:`assert_same_training` compares two runs: losses (relative 1e-5), gradient norms
  (relative 1e-4) and every updated parameter (rtol 1e-5, atol 1e-6); :class:`Equivalence`
  keeps a family's one-process references and checks runs, the two-rank TP plan and the
  searched plan against them.
- :func:`run_main` runs an entry script's ``main(argv)`` on forked ranks; :func:`metrics_records`
  and :func:`metrics_losses` read the metrics file it wrote.
- :func:`layer` and :func:`plan_of` write the plans (global batch 8 unless told);
  :class:`FamilyEquivalenceTests` holds the tests every family runs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import pytest
import torch

from dist_utils import DEFAULT_TIMEOUT_S, run_distributed
from megatron_auto.parallel.optimizer import OptimizerConfig
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.training.lr_scheduler import LRConfig
from megatron_auto.training.precision import PrecisionConfig
from megatron_auto.training.trainer import GPT_TASK, TaskSpec

GLOBAL_BATCH = 8
STEPS = 3
RTOL = 1e-5  # losses and parameters (the equivalence invariant)
GRAD_NORM_RTOL = 1e-4
PARAM_ATOL = 1e-6
REPLICA_ATOL = 1e-7  # copies of one parameter on different ranks


# ----------------------------------------------------------------------------------- plans
def layer(tp=1, dp_mode="ddp", consecutive=True, recompute=False, sp=False, cp=1,
          cp_mode="ring") -> LayerStrategy:
    return LayerStrategy(tp=tp, dp_mode=dp_mode, tp_consecutive=consecutive, recompute=recompute,
                         sequence_parallel=sp, cp=cp, cp_mode=cp_mode)


def plan_of(world_size, layers, *, layers_per_stage=None, num_microbatches=2, schedule="1f1b",
            vocab_tp=1, vocab_dp_mode="ddp", virtual_size=1,
            global_batch_size=GLOBAL_BATCH) -> dict:
    """A plan dict; ``layers_per_stage`` lists the model chunks (``pp * virtual_size``)."""
    lps = tuple(layers_per_stage or (len(layers),))
    return Plan(world_size=world_size, global_batch_size=global_batch_size,
                num_microbatches=num_microbatches,
                pipeline=PipelineSpec(size=len(lps) // virtual_size, schedule=schedule,
                                      layers_per_stage=lps, virtual_size=virtual_size),
                vocab=VocabStrategy(tp=vocab_tp, dp_mode=vocab_dp_mode),
                layers=tuple(layers)).to_dict()


def layer_and_input(config, groups, batch, *, sp, seed=None, **layer_kwargs):
    """One ``TransformerLayer`` of ``config`` on ``groups`` (``layer_kwargs``: e.g. its
    recompute), weights drawn N(0, 0.02) (after ``torch.manual_seed(seed)`` when given), and a
    ``(batch, s, h)`` input that requires grad, split along the sequence under SP."""
    from megatron_auto.models.transformer import TransformerLayer
    from megatron_auto.parallel.mappings import scatter_to_sequence

    module = TransformerLayer(config, groups, sequence_parallel=sp, **layer_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(batch, config.seq_length, config.hidden_size)
    if sp:
        x = scatter_to_sequence(x, groups.tp_group)
    return module, x.requires_grad_()


def one_process_plan(num_layers: int) -> dict:
    """The reference: one rank, one micro-batch."""
    return plan_of(1, [layer()] * num_layers, num_microbatches=1)


@dataclass(frozen=True)
class Searched:
    """The plan ``--auto-parallel`` finds with ``argv`` on the ranks of the run (collective):
    ``add_args`` extends the base parser with the family's flags, ``config_from_args`` is the
    family's flags -> config conversion."""

    argv: tuple[str, ...]
    add_args: Callable[[Any], Any] | None = None
    config_from_args: Callable[[Any], Any] | None = None

    def __call__(self, world_size: int, config: Any) -> Plan:
        from megatron_auto import auto
        from megatron_auto.arguments import build_parser, parse_run_config

        parser = build_parser()
        if self.add_args is not None:
            parser = self.add_args(parser)
        kwargs = {} if self.config_from_args is None else {
            "model_config_from_args": self.config_from_args}
        run = parse_run_config(list(self.argv), parser, **kwargs)
        return auto.plan_for_run(run.plan_source, config, world_size,
                                 precision=run.precision.name)


# ---------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class Recipe:
    """What one family's equivalence tests train: ``config`` (any family's model config),
    ``stage(config, ctx, seed)`` (the stage provider), ``batch(step)`` (the global batch of a
    step, the same on every rank), the optimizer, LR schedule, precision and task, and what to
    ``observe`` after each step."""

    config: Any
    stage: Callable[[Any, Any, int], torch.nn.Module]
    batch: Callable[[int], dict]
    optimizer: OptimizerConfig = OptimizerConfig(weight_decay=0.1, clip_grad=1.0, adam_eps=1e-6)
    lr: LRConfig = LRConfig(lr=1e-3, decay_style="constant")
    precision: PrecisionConfig = PrecisionConfig()
    task: TaskSpec = GPT_TASK
    seed: int = 1234
    #: called with the trainer after every step on every rank; what it returns is kept per rank
    #: and step (``Trained.observed``): a feature's own statistics (MoE's, ...)
    observe: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Trained:
    """One plan's run: rank 0's ``results`` (``StepResult`` fields per step, steps
    ``first_step ..``), the full parameters ``state`` merged over ranks, the ``plan`` dict
    trained, each rank's final ``iterations`` and ``consumed_samples``, and per rank what the
    recipe's ``observe`` returned after each step (empty lists without one)."""

    results: list[dict]
    state: dict[str, torch.Tensor]
    plan: dict
    first_step: int = 0
    iterations: tuple[int, ...] = ()
    consumed_samples: tuple[int, ...] = ()
    observed: tuple[list[Any], ...] = ()

    @property
    def losses(self) -> list[float]:
        return [r["lm_loss"] for r in self.results]


@dataclass(frozen=True)
class Job:
    """One training run of a fork (:func:`run_jobs`): ``recipe`` trains ``plan`` (a plan dict or
    a :class:`Searched`) over steps ``first_step .. last_step - 1``, after loading ``load_dir``
    (which must return ``first_step``) when given, saving to ``save_dir`` at the end when
    given."""

    recipe: Recipe
    plan: Any
    first_step: int = 0
    last_step: int = STEPS
    load_dir: str | None = None
    save_dir: str | None = None


def build(recipe: Recipe, plan: Plan) -> Any:
    """The recipe's trainer for ``plan`` on this rank (collective)."""
    from megatron_auto.training.trainer import build_trainer

    return build_trainer(recipe.config, plan, recipe.stage, optimizer_config=recipe.optimizer,
                         lr_config=recipe.lr, precision=recipe.precision, seed=recipe.seed,
                         task=recipe.task)


def train_steps(trainer: Any, recipe: Recipe, steps: range) -> tuple[list[dict], list[Any]]:
    """``train_step`` for each step of ``steps`` (ranks that read no data get no batch): the
    per-step results, and what ``recipe.observe`` returned after each step (if it is set)."""
    from megatron_auto.training.trainer import train_step

    results, observed = [], []
    for step in steps:
        results.append(train_step(trainer, recipe.batch(step) if trainer.reads_data
                                  else None).__dict__)
        if recipe.observe is not None:
            observed.append(recipe.observe(trainer))
    return results, observed


def _train_worker(rank: int, world_size: int, jobs: list[Job]) -> list[dict]:
    from megatron_auto.models.init import gather_full_state
    from megatron_auto.training.checkpoint import load_checkpoint, save_checkpoint

    out = []
    for job in jobs:
        recipe = job.recipe
        plan = (job.plan(world_size, recipe.config) if isinstance(job.plan, Searched)
                else Plan.from_dict(job.plan))
        trainer = build(recipe, plan)
        if job.load_dir:
            assert load_checkpoint(trainer, job.load_dir) == job.first_step
        results, observed = train_steps(trainer, recipe, range(job.first_step, job.last_step))
        if job.save_dir:
            save_checkpoint(trainer, job.save_dir)
        out.append({"results": results, "state": gather_full_state(trainer.stage),
                    "plan": plan.to_dict(), "iteration": trainer.iteration,
                    "consumed": trainer.consumed_samples, "observed": observed})
    return out


def merge_states(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One full state from every rank's: a parameter held by several ranks (DP replicas, tied
    copies, tables shared across stages) must agree (rtol 1e-5, atol 1e-7)."""
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        for name, value in state.items():
            if name in merged:
                torch.testing.assert_close(value, merged[name], rtol=RTOL, atol=REPLICA_ATOL)
            merged[name] = value
    return merged


def run_jobs(world_size: int, jobs: Sequence[Job]) -> list[Trained]:
    """Run ``jobs`` one after the other on ``world_size`` forked ranks (one start-up for all,
    whatever their recipes) and return each one's :class:`Trained`."""
    jobs = list(jobs)
    per_rank = run_distributed(_train_worker, world_size, jobs)
    return [Trained(results=per_rank[0][p]["results"],
                    state=merge_states([out[p]["state"] for out in per_rank]),
                    plan=per_rank[0][p]["plan"], first_step=job.first_step,
                    iterations=tuple(out[p]["iteration"] for out in per_rank),
                    consumed_samples=tuple(out[p]["consumed"] for out in per_rank),
                    observed=tuple(out[p]["observed"] for out in per_rank))
            for p, job in enumerate(jobs)]


def run_plans(recipe: Recipe, world_size: int, plans: Sequence[Any] | Searched,
              steps: int | Sequence[int] = STEPS) -> list[Trained]:
    """Train each plan (a dict, or a :class:`Searched` plan) for ``steps`` steps from a fresh
    start on ``world_size`` forked ranks; ``steps`` is one count or one per plan."""
    plans = [plans] if isinstance(plans, Searched) else list(plans)
    counts = [steps] * len(plans) if isinstance(steps, int) else list(steps)
    return run_jobs(world_size, [Job(recipe, p, 0, n) for p, n in zip(plans, counts)])


def run_named(recipe: Recipe, world_size: int, plans: Mapping[str, Any],
              steps: int = STEPS) -> dict[str, Trained]:
    """:func:`run_plans` of a name -> plan table, in one forked run."""
    return dict(zip(plans, run_plans(recipe, world_size, list(plans.values()), steps)))


def run_phase(recipe: Recipe, world_size: int, plan: dict, first_step: int, last_step: int, *,
              load_dir: Any = None, save_dir: Any = None) -> Trained:
    """Steps ``first_step .. last_step - 1`` of ``plan``: after loading ``load_dir`` (which
    must return ``first_step``) when given, saving to ``save_dir`` at the end when given."""
    job = Job(recipe, plan, first_step, last_step, str(load_dir) if load_dir else None,
              str(save_dir) if save_dir else None)
    return run_jobs(world_size, [job])[0]


def assert_same_training(reference: Trained, candidate: Trained, label: str, *,
                         grad_norms: bool = True) -> None:
    """``candidate`` trained what ``reference`` trained over the candidate's steps: each
    loss within relative 1e-5 and gradient norm within 1e-4 of the reference's same step,
    the same parameter names, every parameter within rtol 1e-5, atol 1e-6."""
    start = candidate.first_step - reference.first_step
    ref_results = reference.results[start:start + len(candidate.results)]
    assert candidate.results and start >= 0 and len(ref_results) == len(candidate.results), \
        f"{label}: steps {candidate.first_step}+{len(candidate.results)} not in the reference"
    for step, (r, c) in enumerate(zip(ref_results, candidate.results), candidate.first_step):
        assert abs(c["lm_loss"] - r["lm_loss"]) <= RTOL * abs(r["lm_loss"]), \
            f"{label}: step {step} loss {c['lm_loss']} vs one process {r['lm_loss']}"
        if grad_norms:
            assert abs(c["grad_norm"] - r["grad_norm"]) <= GRAD_NORM_RTOL * abs(r["grad_norm"]), \
                f"{label}: step {step} grad norm {c['grad_norm']} vs {r['grad_norm']}"
    assert set(candidate.state) == set(reference.state), f"{label}: parameter names differ"
    for name, value in reference.state.items():
        torch.testing.assert_close(candidate.state[name], value, rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, n=name: f"{label}: {n}: {m}")


class Equivalence:
    """One family's model against one process (``label`` names it in failures): the
    one-process reference of each step count, run once per session, and the comparisons."""

    def __init__(self, recipe: Recipe, label: str) -> None:
        self.recipe, self.label = recipe, label
        self._references: dict[int, Trained] = {}
        self._tables: dict[str, dict[str, Trained]] = {}

    def reference(self, steps: int = STEPS) -> Trained:
        if steps not in self._references:
            (self._references[steps],) = run_plans(
                self.recipe, 1, [one_process_plan(self.recipe.config.num_layers)], steps)
        return self._references[steps]

    def run(self, world_size: int, plans: Sequence[Any] | Searched,
            steps: int | Sequence[int] = STEPS) -> list[Trained]:
        return run_plans(self.recipe, world_size, plans, steps)

    def run_named(self, world_size: int, plans: Mapping[str, Any],
                  steps: int = STEPS) -> dict[str, Trained]:
        return run_named(self.recipe, world_size, plans, steps)

    def check_named(self, world_size: int, plans: Mapping[str, Any], name: str) -> None:
        """Plan ``name`` of the table ``plans`` matches one process; the whole table is trained
        in one forked run, the first time one of its plans is asked for."""
        key = json.dumps([world_size, plans], sort_keys=True)
        if key not in self._tables:
            self._tables[key] = self.run_named(world_size, plans)
        self.check(self._tables[key][name], name)

    def check(self, trained: Trained, name: str) -> None:
        """``trained`` equals the one-process run of as many steps
        (:func:`assert_same_training`)."""
        assert_same_training(self.reference(len(trained.results)), trained,
                             f"{self.label} {name}")

    def reference_trains(self) -> Trained:
        """The one-process run the others are compared with, after checking that it moves the
        loss over its three steps and holds the config's parameter count (so its equality with
        another run means something)."""
        ref = self.reference()
        assert len(ref.results) == STEPS
        assert ref.results[-1]["lm_loss"] != ref.results[0]["lm_loss"]
        assert sum(v.numel() for v in ref.state.values()) == self.recipe.config.num_parameters()
        return ref

    def check_tensor_parallel(self, world_size: int = 2, steps: int = STEPS) -> None:
        """Every layer and the vocabulary on TP ``world_size`` matches one process."""
        plan = plan_of(world_size, [layer(tp=world_size)] * self.recipe.config.num_layers,
                       vocab_tp=world_size)
        (trained,) = self.run(world_size, [plan], steps)
        assert len(trained.results) == steps
        self.check(trained, f"tp{world_size}")

    def check_searched(self, searched: Searched, world_size: int) -> dict:
        """The plan ``--auto-parallel`` finds on ``world_size`` ranks (for the harness's
        global batch) matches one process; returns that plan."""
        (trained,) = self.run(world_size, searched)
        plan = trained.plan
        assert plan["world_size"] == world_size and plan["global_batch_size"] == GLOBAL_BATCH
        self.check(trained, f"--auto-parallel plan {plan['pipeline']} {plan['layers']}")
        return plan


class FamilyEquivalenceTests:
    """The equivalence tests every model family runs against one process (whose module checks
    it with :meth:`Equivalence.reference_trains`): TP over two ranks, the plan
    ``--auto-parallel`` finds on four ranks, and each plan of ``four_rank_plans`` on four ranks. A family's test module
    subclasses it as ``Test...`` and sets the attributes; ``searched_model`` lists fields the
    searched plan's ``model`` record must have."""

    equivalence: Equivalence
    searched: Searched
    searched_model: Mapping[str, Any]
    four_rank_plans: Mapping[str, dict]

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "four_rank_plan" in metafunc.fixturenames:
            metafunc.parametrize("four_rank_plan", list(self.four_rank_plans))

    @pytest.mark.multirank
    def test_tensor_parallel_two_ranks_matches_one_process(self) -> None:
        self.equivalence.check_tensor_parallel(2)

    @pytest.mark.multirank
    def test_auto_parallel_plan_on_four_ranks_matches_one_process(self) -> None:
        plan = self.equivalence.check_searched(self.searched, 4)
        for field, value in self.searched_model.items():
            assert plan["model"][field] == value, (field, plan["model"])

    @pytest.mark.multirank
    def test_four_rank_plan_matches_one_process(self, four_rank_plan: str) -> None:
        self.equivalence.check_named(4, self.four_rank_plans, four_rank_plan)


# ----------------------------------------------------------------------------- entry scripts
def _main_worker(rank: int, world_size: int, script: str, argv: list[str],
                 env: Mapping[str, str], capture: str | None) -> Any:
    os.environ.update(env)
    main = importlib.import_module(script).main
    if capture is None:
        return main(argv)
    text = io.StringIO()
    redirect = contextlib.redirect_stderr if capture == "stderr" else contextlib.redirect_stdout
    with redirect(text):
        code = main(argv)
    return code, text.getvalue()


def run_main(script: str, world_size: int, argv: Sequence[str], *,
             env: Mapping[str, str] | None = None, capture: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """``script.main(argv)`` (an entry script: ``pretrain_gpt``, ...) on ``world_size`` forked
    gloo ranks, with ``env`` set first (e.g. ``MEGATRON_AUTO_CACHE``). Per rank: the exit
    status, or with ``capture`` (``"stdout"`` or ``"stderr"``) ``(status, what it wrote)``."""
    if capture not in (None, "stdout", "stderr"):
        raise ValueError(f"capture={capture!r}: choose 'stdout', 'stderr' or None")
    return run_distributed(_main_worker, world_size, script, list(argv), dict(env or {}),
                           capture, timeout_s=timeout_s)


def train_from_flags(script: str, world_size: int, argv: Sequence[str], tmp_path: Any, *,
                     env: Mapping[str, str] | None = None) -> list[dict]:
    """Run ``script`` with ``argv`` and ``--metrics-file`` in ``tmp_path`` on ``world_size``
    forked ranks (every rank must exit 0) and return the metrics file's records."""
    metrics = tmp_path / f"{script}.jsonl"
    assert run_main(script, world_size, [*argv, "--metrics-file", str(metrics)],
                    env=env) == [0] * world_size
    return metrics_records(metrics)


def assert_one_error_line(script: str, argv: Sequence[str], message: str, capfd: Any) -> None:
    """``script`` on one forked rank stops with exit status 2 and one ``error:`` line that
    starts with ``message``, and no traceback (``capfd``: pytest's fixture)."""
    assert run_main(script, 1, argv) == [2]
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), err[-2000:]
    assert "Traceback" not in err


def metrics_records(path: Any, *, missing_ok: bool = False) -> list[dict]:
    """Every record of a metrics file (``--metrics-file``), in order. A missing file fails
    (a run that should have written one did not), unless ``missing_ok`` (polling a run that
    has not written its first record yet): then none."""
    if missing_ok and not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().splitlines() if line.strip()]


def metrics_losses(path: Any, key: str = "lm_loss") -> dict[int, float]:
    """Iteration -> training loss of a metrics file (evaluation records left out); a restarted
    run repeats iterations: the last record of each counts."""
    return {r["iteration"]: r[key] for r in metrics_records(path) if r.get("split") != "valid"}


def assert_resume_continues(script: str, argv: Sequence[str], tmp_path: Any,
                            resume_world_size: int, resume_flags: Sequence[str], *,
                            iters: int = 3, split: int = 1) -> None:
    """A checkpoint saved by one process after ``split`` of ``iters`` iterations and resumed on
    ``resume_world_size`` ranks with ``resume_flags`` (another plan) continues where it stopped:
    the resumed losses equal the uninterrupted one-process run's (relative 1e-5)."""
    ckpt = tmp_path / "ckpt"
    full, first, resumed = (tmp_path / n for n in ("full.jsonl", "first.jsonl", "resumed.jsonl"))
    assert run_main(script, 1, [*argv, "--train-iters", str(iters),
                                "--metrics-file", str(full)]) == [0]
    assert run_main(script, 1, [*argv, "--train-iters", str(split), "--save", str(ckpt),
                                "--metrics-file", str(first)]) == [0]
    assert run_main(script, resume_world_size, [
        *argv, "--train-iters", str(iters), "--load", str(ckpt), *resume_flags,
        "--metrics-file", str(resumed)]) == [0] * resume_world_size
    want = [r["lm_loss"] for r in metrics_records(full)][split:]
    got = [r["lm_loss"] for r in metrics_records(resumed)]
    assert got == pytest.approx(want, rel=RTOL)
