"""megatron_auto.data"""
