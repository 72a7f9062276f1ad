"""megatron_auto.models"""
