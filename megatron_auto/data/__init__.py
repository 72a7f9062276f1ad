"""Data pipeline: Megatron-compatible indexed datasets, tokenizers, GPT/BERT datasets.

The training loop calls only what is re-exported here:

- ``build_tokenizer(tokenizer_type, tokenizer_model=None, vocab_file=None, merge_file=None,
  vocab_size=None)``
- ``parse_data_path(data_path) -> (prefixes, weights | None)``
- ``build_train_valid_test_datasets(data_prefix, split, seq_length, seed, train_samples,
  valid_samples, test_samples, cache_dir=None, model="gpt", tokenizer=None, ...)``
- ``MockGPTDataset(vocab_size, seq_length, num_samples, seed)`` and ``MockBertDataset(...)``
- ``embedded_dataset(cache_dir=None, split_sentences=False) -> (data_prefix, tokenizer_model)``
  with ``EMBEDDED_TOKENIZER_TYPE`` the tokenizer type to build for it (``split_sentences=True``
  gives the sentence-level files for BERT; document-level files work for BERT too).
"""

from megatron_auto.data.bert_dataset import BertDataset, MockBertDataset
from megatron_auto.data.blended_dataset import BlendedDataset
from megatron_auto.data.builder import build_train_valid_test_datasets, parse_data_path, parse_split
from megatron_auto.data.embedded import TOKENIZER_TYPE as EMBEDDED_TOKENIZER_TYPE
from megatron_auto.data.embedded import embedded_dataset
from megatron_auto.data.errors import DataInputError
from megatron_auto.data.gpt_dataset import GPTDataset, MockGPTDataset
from megatron_auto.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from megatron_auto.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

__all__ = [
    "BertDataset",
    "BlendedDataset",
    "DataInputError",
    "EMBEDDED_TOKENIZER_TYPE",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "MockBertDataset",
    "MockGPTDataset",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "embedded_dataset",
    "parse_data_path",
    "parse_split",
]
