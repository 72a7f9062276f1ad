"""``python -m megatron_auto ...``: the ``megatron-auto`` console script."""

from .console import main

main()
