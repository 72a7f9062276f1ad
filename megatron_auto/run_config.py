"""What one training run is told to do: typed, frozen, torch-free (docs/design.md §8).

``arguments.parse_run_config(argv)`` makes one :class:`RunConfig` from the command line at the
entry point; ``training.pretrain.pretrain()`` takes it, and everything below sees only these
dataclasses (never an argparse namespace). Each component's settings are its own dataclass:

- :class:`~megatron_auto.config.ModelConfig` (``config.py``): the model shape and numerics;
- :class:`DataConfig`: data source and tokenizer; :class:`OptimizerConfig`; :class:`LRConfig`;
  :class:`PrecisionConfig`; :class:`LoggingConfig`; :class:`ExperimentLogConfig` (TensorBoard,
  W&B); :class:`TrainingConfig` (iterations,
  evaluation, seed); :class:`CheckpointConfig`;
- the plan source: a :class:`PlanFile`, the :class:`ClassicLayout` flags, or the search with
  the choices the user pinned (:class:`SearchPins`); ``plan_source.make_plan`` and
  ``auto.plan_for_run`` make the plan from it.

No module here imports torch, so the ``megatron-auto`` planning commands, which read the same
flags, start without it. :func:`resolve_precision` (defined in ``config.py``, re-exported) is the
one rule from ``--bf16``/``--fp16`` to a precision name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import DEFAULT_GLOBAL_BATCH_SIZE, ArgumentError, ModelConfig, resolve_precision

__all__ = ["DEFAULT_GLOBAL_BATCH_SIZE", "CheckpointConfig", "DataConfig", "ExperimentLogConfig",
           "ExperimentLogError", "LRConfig",
           "LoggingConfig", "OptimizerConfig", "PrecisionConfig", "RunConfig", "TrainingConfig",
           "resolve_precision", "PlanFile", "ClassicLayout", "SearchPins"]


# torch.compile backends --compile accepts (models/compile.py uses them).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


# ----------------------------------------------------------------------------- components
@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision and fp16 loss scaling (``training/precision.py`` applies it)."""

    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None  # static scale; None = dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        resolve_precision(self.bf16, self.fp16)

    @property
    def name(self) -> str:
        """``fp32``, ``bf16`` or ``fp16`` (the planner's and the profiles' precision names)."""
        return resolve_precision(self.bf16, self.fp16)  # type: ignore[return-value]


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters and the gradient clip (``parallel/optimizer.py`` builds it)."""

    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables it


DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class LRConfig:
    """The learning-rate schedule (``training/lr_scheduler.py`` evaluates it)."""

    lr: float = 1e-3
    min_lr: float = 0.0
    decay_style: str = "cosine"
    warmup_iters: int = 0
    decay_iters: int = 100
    wsd_decay_iters: int | None = None  # default: 10% of the decay horizon
    wsd_decay_style: str = "linear"

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style={self.decay_style}: choose one of "
                             f"{', '.join(DECAY_STYLES)}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style={self.wsd_decay_style}: choose one of "
                             f"{', '.join(WSD_DECAY_STYLES)}")
        if self.decay_style != "constant" and self.decay_iters < 1:
            raise ValueError(f"--lr-decay-iters={self.decay_iters}: must be a positive integer")
        if self.decay_style == "WSD" and self.wsd_decay_iters is not None and not (
                0 < self.wsd_decay_iters <= self.decay_iters - self.warmup_iters):
            raise ValueError(
                f"--lr-wsd-decay-iters={self.wsd_decay_iters}: must be in 1.."
                f"{self.decay_iters - self.warmup_iters} (--lr-decay-iters minus warm-up)")


@dataclass(frozen=True)
class DataConfig:
    """Where the training data comes from and its tokenizer (``training/data.py`` resolves it)."""

    data_path: tuple[str, ...] = ()
    mock_data: bool = False
    split: str = "969,30,1"
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    eod_mask_loss: bool = False
    cache_dir: str | None = None
    vocab_extra_ids: int = 0  # T5 sentinels added to the tokenizer (Megatron's --vocab-extra-ids)

    @property
    def source(self) -> str:
        return "mock" if self.mock_data else "files" if self.data_path else "embedded"


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 10
    metrics_file: str | None = None
    timing_log_level: int = 0  # --timing-log-level: 0 off, 1 the breakdown, 2 finer (+ CUDA syncs)
    timing_log_option: str = "minmax"  # --timing-log-option: max | minmax | all (console only)

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"--log-interval={self.log_interval}: must be a positive integer")
        if self.timing_log_level not in (0, 1, 2):
            raise ValueError(f"--timing-log-level={self.timing_log_level}: choose 0, 1 or 2")
        if self.timing_log_option not in ("max", "minmax", "all"):
            raise ValueError(f"--timing-log-option={self.timing_log_option!r}: choose max, "
                             f"minmax or all")


class ExperimentLogError(ArgumentError):
    """A logging flag that cannot work here; the message names the flag and the fix."""


@dataclass(frozen=True)
class ExperimentLogConfig:
    """The TensorBoard and W&B flags (Megatron-LM names); ``training/experiment_log.py`` writes
    the metrics records to them."""

    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    log_timers_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None

    def __post_init__(self) -> None:
        if self.tensorboard_log_interval < 1:
            raise ExperimentLogError(
                f"--tensorboard-log-interval={self.tensorboard_log_interval}: must be a positive "
                f"integer (e.g. 1)")
        if self.wandb_project is not None and not self.wandb_project.strip():
            raise ExperimentLogError("--wandb-project='': give a project name, or drop the flag")

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard_dir or self.wandb_project)


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int = 100
    eval_interval: int = 50
    eval_iters: int = 5
    seed: int = 1234
    compile_backend: str | None = None  # --compile: torch.compile backend; None = eager
    check_for_nan_in_loss_and_grad: bool = False  # stop on a non-finite loss or gradient
    # Ending early (training/exit_control.py): catch SIGTERM (None: only when --save is given),
    # stop after this many minutes, stop at iterations divisible by this.
    exit_signal_handler: bool | None = None
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None

    def __post_init__(self) -> None:
        if self.compile_backend is not None and self.compile_backend not in COMPILE_BACKENDS:
            raise ArgumentError(f"--compile-backend={self.compile_backend}: unknown; choose one "
                                f"of {', '.join(COMPILE_BACKENDS)}")


@dataclass(frozen=True)
class CheckpointConfig:
    """``--save DIR`` every ``save_interval`` iterations (and at the end); ``--load DIR``."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    async_save: bool = False  # --async-save: dcp.async_save, written in the background
    load_fallback: bool = True  # a damaged checkpoint falls back to the previous intact one
    # --overwrite: --save may replace a checkpoint of another run (one --load does not continue)
    overwrite: bool = False


# ----------------------------------------------------------------------------- plan sources


@dataclass(frozen=True)
class PlanFile:
    """``--plan FILE``; the batch flags are only checked against (or ignored for) the file's."""

    path: str
    global_batch_size: int | None = None
    micro_batch_size: int | None = None


@dataclass(frozen=True)
class ClassicLayout:
    """Megatron's layout flags; ``None`` sizes count as 1, ``None`` batches take the defaults
    (global :data:`DEFAULT_GLOBAL_BATCH_SIZE`; micro the largest of 4, 2, 1 that splits each
    replica's share)."""

    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    use_distributed_optimizer: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None  # --recompute-modules (selective)
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    sequence_parallel: bool = False  # --sequence-parallel: every layer (ignored at tp 1)
    num_layers_per_virtual_pipeline_stage: int | None = None  # interleaved 1F1B chunks
    pipeline_model_parallel_layout: str | None = None  # Megatron-Core's partition string
    use_megatron_fsdp: bool = False  # with data_parallel_sharding_strategy: zero1/2/3
    data_parallel_sharding_strategy: str | None = None
    context_parallel_size: int = 1  # --context-parallel-size: every layer's cp
    cp_comm_type: str = "p2p"  # --cp-comm-type: p2p = ring, a2a = ulysses
    expert_model_parallel_size: int = 1  # --expert-model-parallel-size: every MoE layer's ep
    expert_tensor_parallel_size: int = 1  # --expert-tensor-parallel-size: every MoE layer's
    optimizer_offload_fraction: float = 0.0  # --optimizer-cpu-offload / -offload-fraction


@dataclass(frozen=True)
class SearchPins:
    """``--auto-parallel``: the choices the user typed (``None``: not typed, the planner
    chooses), found in the same parse as every other flag; plus the hardware to plan for."""

    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    use_distributed_optimizer: bool = False
    recompute_granularity: str | None = None
    cluster: str | None = None
    memory_budget_gb: float | None = None
    optimality_gap: float | None = None  # --optimality-gap (None: the search's default)
    sequence_parallel: bool = False  # --sequence-parallel: SP on every layer with tp > 1
    num_layers_per_virtual_pipeline_stage: int | None = None  # pins the virtual size
    context_parallel_size: int | None = None  # --context-parallel-size (None: searched)
    cp_comm_type: str | None = None  # --cp-comm-type (None: ring and Ulysses searched)
    cp_min_seq_length: int | None = None  # --cp-min-seq-length (None: the search's 8192)
    # --expert-model-parallel-size (None: every MoE layer's ep searched)
    expert_model_parallel_size: int | None = None
    expert_tensor_parallel_size: int | None = None  # --expert-tensor-parallel-size (searched)
    # --host-memory-budget-gb (None: the search offloads nothing)
    host_memory_budget_gb: float | None = None

    @property
    def batch(self) -> int:
        return self.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE



# ----------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs from its command line, converted once.

    ``model`` is a :class:`ModelConfig` whose ``vocab_size`` is the flags' (``--vocab-size`` or
    the mock default; the run replaces it by its tokenizer's), or the model config of a family
    with its own flags (the vision classifiers' ``VisionConfig``). ``plan_source`` says where the plan comes from; the plan itself needs
    the world size and is made (and validated, once) when the run starts.
    The batch flags travel with the plan source, which is what uses them (a plan file's own
    batch rules; the search treats a typed value as a pin).
    """

    model: Any = field(default_factory=ModelConfig)  # ModelConfig, or e.g. a VisionConfig
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    lr: LRConfig = LRConfig()
    precision: PrecisionConfig = PrecisionConfig()
    logging: LoggingConfig = LoggingConfig()
    experiment_log: ExperimentLogConfig = ExperimentLogConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed_timeout_minutes: float = 10.0  # collective timeout (Megatron's flag)
    plan_source: PlanFile | ClassicLayout | SearchPins = ClassicLayout()
    plan_out: str | None = None
