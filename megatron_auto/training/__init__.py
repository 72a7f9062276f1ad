"""megatron_auto.training: the run and what it needs.

- ``pretrain.py``: ``launch()`` (entry scripts: argv → ``RunConfig`` → ``pretrain()``),
  ``pretrain()`` (the run: data, plan, trainer, loop, checkpoints)
- ``trainer.py``: ``build_trainer()`` / ``train_step()`` / ``evaluate()`` (one iteration; tests
  drive these), ``Trainer``, ``TaskSpec``
- ``checkpoint.py``: torch.distributed.checkpoint save/load (also asynchronous), resharded
  across plans; ``checkpoint_verify.py``: the verification record and the choice of the
  checkpoint to load (fallback from a damaged one)
- ``exit_control.py``: SIGTERM, ``--exit-duration-in-mins``, ``--exit-interval``
- ``lr_scheduler.py``: warm-up + constant/linear/cosine/WSD (``lr_at``)
- ``precision.py``: autocast dtype and fp16 loss scaling (``LossScaler``)
- ``data.py``: data sources and global batch → micro-batches
- ``logging.py`` / ``metrics.py``: Megatron console lines, the ``--metrics-file`` writer

The configuration dataclasses (``TrainingConfig``, ``LRConfig``, ``PrecisionConfig``,
``DataConfig``, ...) live in ``megatron_auto/run_config.py``, torch-free. The optimizer
(``parallel/optimizer.py``) and the peak-memory meter (``parallel/memory.py``) live below, where
the profiler uses them too. Submodules are imported on use: ``pretrain`` pulls in the whole
runtime.
"""
