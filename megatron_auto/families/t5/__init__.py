"""The T5 encoder-decoder family: ``config`` (:class:`~.config.T5Config`) and ``flags``
(``pretrain_t5.py``'s flags). Imports nothing, so that the models can read the config."""
