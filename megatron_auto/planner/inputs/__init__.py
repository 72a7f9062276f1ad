"""What the planner plans from: the model as layer types (``model_spec``), per-layer-type
profiles (``profiles``), cluster descriptions and their presets (``hardware``, ``presets``) and the
typed view the cost model takes of a cluster (``cluster_model``)."""
