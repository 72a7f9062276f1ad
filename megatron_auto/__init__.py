"""megatron_auto: Megatron-style training whose parallel layout is searched (Galvatron-BMW)."""

__version__ = "0.1.0"
