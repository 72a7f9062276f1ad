"""megatron_auto.training"""
