"""Checkpoint conversion: our GPT / BERT checkpoints <-> Hugging Face ``transformers`` models.

``hf_mapping`` maps the parameters (pure tensor arithmetic), ``checkpoint_files`` reads and
writes our DCP checkpoints whole in one process, ``hf`` joins them with ``transformers``
(optional). The command is ``tools/checkpoint/convert.py`` (docs/convert.md).
"""
