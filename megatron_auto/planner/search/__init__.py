"""The search: strategy spaces (``spaces``), search tasks and their bound tables (``tasks``,
``layer_tables``, ``stage_costs``), the exact branch and bound of one task (``exact``, with
``bottleneck`` and ``dominance``), its seeds (``seeds``, ``stage_dp``, ``partition``), least-memory
and infeasibility reports, and the driver over every task and baseline space (``driver``)."""
