"""Tokenizers in conversion: ours -> transformers' files and an HF directory -> our flags.

Every tokenizer is built here from a corpus written here (GPT-2 byte-level BPE and BERT
WordPiece trained by the ``tokenizers`` library, SentencePiece BPE and unigram models trained
by ``sentencepiece``, and the SentencePiece model the package ships): no download. Each is
exported with :func:`export_tokenizer`, loaded back with ``AutoTokenizer.from_pretrained`` and
must give our ids on texts other than the exporter's own probe (spaces, tabs, newlines,
accents, CJK, an emoji); :func:`tokenizer_flags` of the directory must name our tokenizer type,
whose ids again match. The command-line test imports an HF LLaMA with its tokenizer and exports
it back with ``--tokenizer-type``.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from megatron_auto.conversion.hf_mapping import ConversionError
from megatron_auto.conversion.hf_tokenizer import (PROBE_TEXT, TokenizerSpec, export_tokenizer,
                                                   tokenizer_flags)
from megatron_auto.data.tokenizers import build_tokenizer

pytestmark = [pytest.mark.single,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (the test extra has it)")]

CORPUS = [f"The quick brown fox {i} jumps over the lazy dog. Café naïve résumé, 中文 über!"
          for i in range(200)] + ["def f(x):\n    return x ** 2  # a comment"] * 20
TEXTS = ["Hello world", "  leading spaces and  double  spaces.\nA new line\tand a tab",
         "Ünïcödé – dash … 你好 😀", "def g(y):\n    return y // 3  # comment", "",
         "The QUICK Brown fox, it's 1234 we'll", "résumé naïve CAFÉ"]
CONVERT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tools", "checkpoint", "convert.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> TokenizerSpec of every tokenizer kind, trained on CORPUS."""
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=400, special_tokens=["<|endoftext|>"],
              show_progress=False)
    bpe.save_model(str(root))  # vocab.json, merges.txt
    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train([str(corpus)], vocab_size=200, show_progress=False)
    wp.save_model(str(root))  # vocab.txt
    for kind in ("bpe", "unigram"):  # default ids: no pad, so ours appends pad/CLS/SEP/MASK
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / kind),
                                       vocab_size=80, model_type=kind, minloglevel=2)
    return {
        "gpt2": TokenizerSpec("GPT2BPETokenizer", vocab_file=str(root / "vocab.json"),
                              merge_file=str(root / "merges.txt")),
        "wordpiece-lower": TokenizerSpec("BertWordPieceLowerCase",
                                         vocab_file=str(root / "vocab.txt")),
        "wordpiece-cased": TokenizerSpec("BertWordPieceCase", vocab_file=str(root / "vocab.txt")),
        "sp-bpe-bert": TokenizerSpec("SentencePieceTokenizer",
                                     tokenizer_model=str(root / "bpe.model")),
        "sp-unigram-gpt": TokenizerSpec("GPTSentencePieceTokenizer",
                                        tokenizer_model=str(root / "unigram.model")),
        "embedded": TokenizerSpec("SentencePieceTokenizer", tokenizer_model="embedded"),
    }


def ours_of(spec: TokenizerSpec):
    return build_tokenizer(spec.tokenizer_type, tokenizer_model=spec.tokenizer_model,
                           vocab_file=spec.vocab_file, merge_file=spec.merge_file)


@pytest.mark.parametrize("name", ["gpt2", "wordpiece-lower", "wordpiece-cased", "sp-bpe-bert",
                                  "sp-unigram-gpt", "embedded"])
def test_export_loads_in_transformers_with_our_ids_and_imports_back(files, tmp_path, name):
    from transformers import AutoTokenizer

    spec = files[name]
    if spec.tokenizer_model == "embedded":
        from megatron_auto.data.embedded import embedded_tokenizer_model
        ours = ours_of(TokenizerSpec(spec.tokenizer_type, embedded_tokenizer_model()))
    else:
        ours = ours_of(spec)
    out = str(tmp_path / "hf")
    os.makedirs(out)
    export_tokenizer(spec, out, ours.vocab_size)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(out)
    assert len(hf) == ours.vocab_size
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        if ours.detokenize(ids) == text and not name.startswith("wordpiece"):
            assert hf.decode(ids) == text  # lossless where ours is (no unknown pieces)
    assert hf.convert_tokens_to_ids(hf.eos_token if spec.tokenizer_type != "BertWordPieceLowerCase"
                                    and spec.tokenizer_type != "BertWordPieceCase"
                                    else hf.sep_token) == ours.eod
    assert hf.pad_token_id == ours.pad
    if name == "sp-bpe-bert":  # the specials ours appends after the 80 pieces, same ids
        assert ours.vocab_size == 84 and [hf.convert_tokens_to_ids(t) for t in
                                          ("<PAD>", "<CLS>", "<SEP>", "<MASK>")] == [
            ours.pad, ours.cls, ours.sep, ours.mask] == [80, 81, 82, 83]
    back = tokenizer_flags(out, "gpt" if "gpt" in name else "bert")
    assert back is not None and back.tokenizer_type == spec.tokenizer_type
    native = ours_of(back)
    for text in TEXTS:
        assert native.tokenize(text) == hf.encode(text, add_special_tokens=False), text


def test_a_tokenizer_ours_does_not_implement_is_read_through_transformers(tmp_path):
    """A WordLevel tokenizer.json (no vocab.json / vocab.txt / .model): HuggingFaceTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for line in CORPUS for w in line.split()})
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(tmp_path)
    spec = tokenizer_flags(str(tmp_path), "gpt")
    assert spec == TokenizerSpec("HuggingFaceTokenizer", str(tmp_path))
    assert spec.flags() == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                            str(tmp_path)]
    hf = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    text = "The quick brown fox 3 jumps over zebras"
    assert ours_of(spec).tokenize(text) == hf.encode(text, add_special_tokens=False)
    assert tokenizer_flags(str(tmp_path / "none"), "gpt") is None  # no tokenizer files


def test_bad_tokenizer_flags_are_one_line(files, tmp_path):
    cases = [
        (TokenizerSpec("NullTokenizer"), "--tokenizer-type=NullTokenizer: its ids are numbers"),
        (TokenizerSpec("BertWordPieceCase", vocab_file=files["gpt2"].vocab_file,
                       merge_file=files["gpt2"].merge_file),
         "--merge-file=" + files["gpt2"].merge_file + ": --tokenizer-type BertWordPieceCase does "
                                                      "not read it"),
        (TokenizerSpec("GPT2BPETokenizer", vocab_file=files["gpt2"].vocab_file),
         "--tokenizer-type=GPT2BPETokenizer: needs --merge-file"),
        (TokenizerSpec("Tiktoken"), "--tokenizer-type=Tiktoken: unknown; choose one of"),
        (TokenizerSpec("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "x.model")),
         f"--tokenizer-model='{tmp_path / 'x.model'}': SentencePiece model file not found"),
    ]
    for spec, message in cases:
        with pytest.raises(ConversionError, match=None) as err:
            export_tokenizer(spec, str(tmp_path), 10 ** 6)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value
    with pytest.raises(ConversionError, match=r"the tokenizer has 357 ids but the model's "
                                              r"vocabulary is 60"):
        export_tokenizer(files["gpt2"], str(tmp_path), 60)


def test_convert_tool_imports_the_tokenizer_flags_and_exports_the_tokenizer(files, tmp_path,
                                                                           capsys):
    """HF LLaMA + SentencePiece tokenizer -> our checkpoint (the tool prints the tokenizer
    flags) -> HF again with --tokenizer-type: the exported tokenizer gives the same ids."""
    import importlib.util as iu

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = files["sp-unigram-gpt"]
    ours = ours_of(spec)
    hf_dir = tmp_path / "hf_in"
    os.makedirs(hf_dir)
    export_tokenizer(spec, str(hf_dir), ours.vocab_size)
    LlamaForCausalLM(LlamaConfig(vocab_size=ours.vocab_size, hidden_size=32,
                                 intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=16)).save_pretrained(hf_dir)
    tool = iu.spec_from_file_location("convert_tool", CONVERT)
    module = iu.module_from_spec(tool)
    tool.loader.exec_module(module)
    ckpt, hf_out = tmp_path / "ckpt", tmp_path / "hf_out"
    assert module.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                        "--load-dir", str(hf_dir), "--save-dir", str(ckpt)]) == 0
    printed = capsys.readouterr().out
    assert (f"its tokenizer, for tools/preprocess_data.py and with --data-path: --tokenizer-type "
            f"GPTSentencePieceTokenizer --tokenizer-model {hf_dir / 'tokenizer.model'}") in printed
    assert module.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                        "--load-dir", str(ckpt), "--save-dir", str(hf_out)] + spec.flags()) == 0
    assert "tokenizer as transformers' TokenizersBackend" in capsys.readouterr().out
    back = AutoTokenizer.from_pretrained(hf_out)
    for text in TEXTS + [PROBE_TEXT]:
        assert back.encode(text, add_special_tokens=False) == ours.tokenize(text)
    assert json.loads((hf_out / "config.json").read_text())["vocab_size"] == ours.vocab_size
    # a tokenizer flag without its type, and tokenizer flags on an import, are one line each
    assert module.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                        "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "x"),
                        "--vocab-file", "v.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --vocab-file=v.json: needs --tokenizer-type (the tokenizer it belongs "
                   "to); add it or drop the flag")
