"""megatron_auto.profiler"""
