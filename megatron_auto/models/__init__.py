"""megatron_auto.models: transformer layer and the GPT / BERT pipeline stages."""

from .bert import BertStage
from .gpt import GPTStage
from .init import gather_full_state
from .transformer import TransformerLayer

__all__ = ["BertStage", "GPTStage", "TransformerLayer", "gather_full_state"]
