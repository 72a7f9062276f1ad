"""megatron_auto.training: the loop and what it needs.

- ``pretrain.py``: ``pretrain()`` (entry scripts), ``build_trainer()`` / ``train_step()`` /
  ``evaluate()`` (one iteration; tests drive these), ``TaskSpec``, ``TrainingConfig``
- ``lr_scheduler.py``: warm-up + constant/linear/cosine/WSD (``LRConfig``, ``lr_at``)
- ``precision.py``: autocast dtype and fp16 loss scaling (``PrecisionConfig``, ``LossScaler``)
- ``data.py``: data sources and global batch → micro-batches (``DataConfig``)
- ``logging.py`` / ``metrics.py``: Megatron console lines, the ``--metrics-file`` writer

The optimizer (``parallel/optimizer.py``) and the peak-memory meter (``parallel/memory.py``)
live below, where the profiler uses them too. Submodules are imported on use: ``pretrain`` pulls in the whole runtime.
"""
