"""Model families (GPT/BERT, T5, ViT/Swin): each family's configuration and flags in one place.

``t5/`` and ``vision/`` hold their family's ``config`` (the frozen dataclass the runtime, the
planner and the entry script read) and ``flags`` (the entry script's argparse flags and their
conversion into that config). GPT and BERT build on the package's shared ``config.ModelConfig``
and ``arguments.py``, which every family reuses.

These modules are plain data (no torch, no planner): the models read the configs, so this
package and its family packages import nothing at import time.
"""
