"""megatron_auto.planner"""
