"""The cost model: time (``time_model``) and memory (``memory_model``) of one layer under one
strategy, the terms that matter only on GPUs (``gpu_terms``), the interleaved schedule as the
cost model sees it (``interleaving``), the moves of an activation between layouts
(``moves``), and the estimate of a whole plan (``estimate``)."""
