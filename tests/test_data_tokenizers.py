"""Tokenizers: hand-computed encodings on tiny vocabularies, round trips, clear errors."""

import importlib.util
import json
import sys

import pytest

from megatron_auto.data.embedded import embedded_tokenizer_model
from megatron_auto.data.gpt2_bpe import bytes_to_unicode
from megatron_auto.data.tokenizers import build_tokenizer
from megatron_auto.data.wordpiece import basic_tokenize

BPE_VOCAB = ["h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll", "hell", "hello", "Ġw", "or", "Ġwor",
             "ld", "Ġworld", "<|endoftext|>", "!"]
# Rank order matters: lower lines merge first.
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


@pytest.fixture
def gpt2(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({t: i for i, t in enumerate(BPE_VOCAB)}))
    merges.write_text("#version: 0.2\n" + "\n".join(BPE_MERGES) + "\n")
    return build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))


@pytest.mark.pure
def test_bytes_to_unicode_is_gpt2_table():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    # Known entries of GPT-2's table: space and newline are shifted past 255, letters kept.
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("a")] == "a"
    assert table[0] == chr(256)


@pytest.mark.pure
def test_gpt2_bpe_hand_computed(gpt2):
    ids = {t: i for i, t in enumerate(BPE_VOCAB)}
    assert gpt2.tokenize("hello world") == [ids["hello"], ids["Ġworld"]]
    assert gpt2.tokenize("hello world!") == [ids["hello"], ids["Ġworld"], ids["!"]]
    # h e l d: "h e" (rank 0) first, then "l d" (rank 7); "he l" is not a merge.
    assert gpt2.tokenize("held") == [ids["he"], ids["ld"]]
    # w o r l d: "o r" (5) then "l d" (7); "w or" is not a merge (only "Ġw or").
    assert gpt2.tokenize("world") == [ids["w"], ids["or"], ids["ld"]]
    for text in ["hello world!", "held", "world hello", "hello  world"]:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    assert gpt2.eod == ids["<|endoftext|>"] and gpt2.vocab_size == len(BPE_VOCAB)


@pytest.mark.pure
def test_gpt2_bpe_errors(gpt2, tmp_path):
    with pytest.raises(ValueError, match="not in the vocab; vocab.json and merges.txt do not belong"):
        gpt2.tokenize("xyz")
    with pytest.raises(FileNotFoundError, match="--merge-file=.*not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="v.json")


WP_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "un", "##aff", "##able", "runn", "##ing",
            ",", "!", "中", "cafe", "The"]


@pytest.fixture
def vocab_txt(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(WP_VOCAB) + "\n")
    return str(path)


@pytest.mark.pure
def test_wordpiece_hand_computed(vocab_txt):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_txt)
    ids = {t: i for i, t in enumerate(WP_VOCAB)}
    text = "The unaffable RUNNING, café!中 xyz"
    expected = ["the", "un", "##aff", "##able", "runn", "##ing", ",", "cafe", "!", "中", "[UNK]"]
    assert tok.tokenize(text) == [ids[t] for t in expected]
    assert tok.detokenize(tok.tokenize("the unaffable running")) == "the unaffable running"
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.vocab_size) == (2, 3, 4, 0, len(WP_VOCAB))
    cased = build_tokenizer("BertWordPieceCase", vocab_file=vocab_txt)
    assert cased.tokenize("The the THE") == [ids["The"], ids["the"], ids["[UNK]"]]


@pytest.mark.pure
def test_basic_tokenizer_cjk_controls_punctuation():
    # NUL and U+200B (a format character) are dropped; CJK ideographs become words.
    assert basic_tokenize("a\x00b\u200bc 中文x $5.", lower_case=False) == ["abc", "中", "文", "x", "$", "5", "."]


@pytest.mark.pure
def test_wordpiece_missing_specials(tmp_path):
    path = tmp_path / "v.txt"
    path.write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"lacks special tokens \['\[CLS\]'"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(path))


@pytest.mark.pure
def test_sentencepiece_shipped_model_round_trip():
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=embedded_tokenizer_model())
    for text in ["Return the absolute path of *path*.", "  indented\n\tcode(x=1)  ", "é 中文 ☃ \x01"]:
        assert tok.detokenize(tok.tokenize(text)) == text
    # The shipped model reserves its specials inside its vocab (tools/train_tokenizer.py).
    assert (tok.eod, tok.pad, tok.cls, tok.sep, tok.mask, tok.vocab_size) == (2, 3, 4, 5, 6, 8192)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=embedded_tokenizer_model())
    assert gpt.vocab_size == 8192 and gpt.eod == 2
    with pytest.raises(AttributeError, match="no cls token"):
        gpt.cls


@pytest.mark.pure
def test_sentencepiece_trained_in_test_appends_missing_specials(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=60,
                                   model_type="bpe", minloglevel=2)  # default ids: no pad, no CLS
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "m.model"))
    assert tok.eod == 2  # the model's </s>
    assert sorted([tok.pad, tok.cls, tok.sep, tok.mask]) == [60, 61, 62, 63] and tok.vocab_size == 64
    ids = tok.tokenize("the lazy fox")
    assert tok.detokenize(ids) == "the lazy fox"
    assert tok.detokenize([tok.cls] + ids) == "<CLS>the lazy fox"


@pytest.mark.pure
def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("1 2  99") == [1, 2, 99] and tok.detokenize([1, 2, 99]) == "1 2 99"
    assert tok.eod == 100 and tok.vocab_size == 101
    with pytest.raises(ValueError, match=r"ids \[100\] outside \[0, 100\); raise --vocab-size"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer")


@pytest.mark.pure
def test_unknown_type_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type='GPT3'.*GPT2BPETokenizer"):
        build_tokenizer("GPT3")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model=.*not found"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "none.model"))


@pytest.mark.single
@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_huggingface_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "hello": 5, "world": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    assert ours.tokenize("hello world hello") == [5, 6, 5]
    assert (ours.eod, ours.pad, ours.cls, ours.sep, ours.mask, ours.vocab_size) == (3, 1, 2, 3, 4, 7)


@pytest.mark.pure
def test_huggingface_tokenizer_absent_is_clear(monkeypatch):
    # transformers made unimportable (a None entry in sys.modules makes `import` raise
    # ImportError), so the message is checked whether or not the test extra installed it
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs the `transformers` package"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="gpt2")
