"""megatron_auto.parallel"""
