"""One pins -> SearchOptions mapping: ``megatron-auto plan`` and ``--auto-parallel`` agree.

Both front ends read the layout flags the user typed through ``planner.inputs.pins``; these
tests parse the same flags with each front end's own parser (the ``plan`` subcommand's and the
training scripts' ``--auto-parallel``) and compare the options they search with, and pin the
expected options of each flag.
"""

import itertools

import pytest

from megatron_auto import arguments, cli
from megatron_auto.plan import DP_MODES
from megatron_auto.planner.inputs.pins import search_options
from megatron_auto.planner.search.driver import SearchOptions
from megatron_auto.planning import runtime_options

pytestmark = pytest.mark.pure

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512"]
CLUSTER = ["--cluster", "a100-40g-1x8", "--global-batch-size", "16"]
LAYOUT_FLAGS = (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                ["--use-distributed-optimizer"], ["--sequence-parallel"])


def _plan_options(monkeypatch, tmp_path, flags):
    """The options ``megatron-auto plan`` searches with (the search itself is not run)."""
    seen = []

    class Done(Exception):
        pass

    def fake_search(spec, training, cluster, profile, budget, options, **kw):
        seen.append(options)
        raise Done

    monkeypatch.setattr(cli, "search", fake_search)
    with pytest.raises(Done):
        cli.main(["plan", *MODEL, *CLUSTER, "--quiet", "--plan-out", str(tmp_path / "p.json"),
                  *flags])
    return seen[0]


def _auto_options(flags):
    """The options of ``--auto-parallel`` with the same flags (``auto.plan_for_run`` passes
    exactly this: ``search_options_for``'s options limited by ``runtime_options``, torch-free
    here)."""
    run = arguments.parse_run_config(["--auto-parallel", *MODEL, *CLUSTER[2:], *flags])
    pins = run.plan_source
    return runtime_options(search_options(pins, 8, 8, micro_batch_size=pins.micro_batch_size,
                                          global_batch_size=pins.batch, show_progress=False),
                           run.model)


@pytest.mark.parametrize("chosen", [c for n in range(len(LAYOUT_FLAGS) + 1)
                                    for c in itertools.combinations(range(len(LAYOUT_FLAGS)), n)])
def test_both_front_ends_search_with_the_same_options(monkeypatch, tmp_path, chosen):
    flags = [f for i in chosen for f in LAYOUT_FLAGS[i]]
    assert _plan_options(monkeypatch, tmp_path, flags) == _auto_options(flags)


def test_virtual_size_pin_is_the_same_in_both(monkeypatch, tmp_path):
    flags = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"]
    opts = _plan_options(monkeypatch, tmp_path, flags)
    assert opts == _auto_options(flags) and opts.virtual_sizes == (2,)


def test_each_flag_pins_its_option():
    class Typed:
        tensor_model_parallel_size = 2
        pipeline_model_parallel_size = 4
        use_distributed_optimizer = True
        sequence_parallel = True
        num_layers_per_virtual_pipeline_stage = 1

    opts = search_options(Typed(), 16, 8, micro_batch_size=2, global_batch_size=32)
    # dp = 16 / (2 * 4) = 2: 32 / (2 * 2) = 8 micro-batches; the virtual size 8 / (4 * 1) = 2
    assert (opts.tp, opts.pp, opts.num_microbatches) == (2, 4, 8)
    assert opts.dp_modes == ("zero1",) and opts.sequence_parallel is True
    assert opts.virtual_sizes == (2,)

    class Untyped:
        tensor_model_parallel_size = None
        pipeline_model_parallel_size = None
        use_distributed_optimizer = False
        sequence_parallel = False
        num_layers_per_virtual_pipeline_stage = None

    free = search_options(Untyped(), 16, 8, micro_batch_size=2, global_batch_size=32)
    # nothing typed: every default of SearchOptions (a micro-batch size alone pins nothing)
    assert free == SearchOptions() and free.dp_modes == DP_MODES


def test_micro_batch_that_does_not_divide_names_the_flag():
    class Typed:
        tensor_model_parallel_size = 1
        pipeline_model_parallel_size = 1
        use_distributed_optimizer = False
        sequence_parallel = False
        num_layers_per_virtual_pipeline_stage = None

    with pytest.raises(ValueError, match="--micro-batch-size=3: times the data-parallel size 2 "
                                         "must divide --global-batch-size=16"):
        search_options(Typed(), 2, 8, micro_batch_size=3, global_batch_size=16)
