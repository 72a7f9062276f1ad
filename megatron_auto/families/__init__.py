"""Model families (GPT, BERT, T5, ViT, Swin, and any registered): each family in one place.

``registry`` is the one public registry (docs/families.md): the records of the built-in
families and :func:`~.registry.register_family` for new ones; ``family`` defines the record.
Per family, ``<name>/family.py`` holds its record (spec builder, CLI flags and their
conversion, checkpoint fields, plan record, entry-script flags, its stage and profiler by
reference), ``<name>/config.py`` its config and ``<name>/flags.py`` its entry script's flags
(GPT and BERT use the package's shared ``config.ModelConfig`` and ``arguments.py``).

The configs and flags are plain data on the package's base layer, read by the models; so this
``__init__`` and the family packages' import nothing, and importing a config never loads the
registry (which builds the planner's model specs).
"""
