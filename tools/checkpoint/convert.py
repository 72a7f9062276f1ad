#!/usr/bin/env python
"""Convert checkpoints between megatron_auto and Hugging Face ``transformers``.

Export reads the latest checkpoint of a ``--save`` directory, whatever plan wrote it, and writes
a directory that ``transformers``' ``from_pretrained`` loads: GPT-2 (learned positions,
LayerNorm, GeLU), LLaMA (RoPE, SwiGLU, RMSNorm, grouped-query attention, biases or not, tied or
untied head) or Megatron-BERT. Import reads such a directory and writes a weights-only
checkpoint that ``pretrain_gpt.py --load`` / ``pretrain_bert.py --load`` trains under any plan;
it prints the model flags to train it with. Model flags given to an import must agree with the
Hugging Face config (an error names the one that does not).

Examples::

    # our checkpoint -> transformers (the architecture follows the model: RoPE -> LLaMA)
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \\
        --load-dir checkpoints/gpt --save-dir hf/gpt

    # ... with the tokenizer the data was tokenized with (tokenizer.json and its files)
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \\
        --load-dir checkpoints/gpt --save-dir hf/gpt \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model

    # a transformers LLaMA / GPT-2 directory -> our checkpoint, checked against our flags
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron \\
        --load-dir hf/llama --save-dir checkpoints/llama --seq-length 2048

An import also prints the data tools' tokenizer flags of the directory's tokenizer files.

Errors print one line naming what is wrong and the fix, and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_auto.arguments import add_model_args  # noqa: E402
from megatron_auto.config import ConfigError  # noqa: E402
from megatron_auto.utils.flag_warnings import (  # noqa: E402
    one_line_flag_warnings, warn_flag)

_UNSET = object()  # marks a model flag the user did not give
_REQUIRED = ["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", "-",
             "--save-dir", "-"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("conversion")
    g.add_argument("--model-type", required=True, choices=["GPT", "BERT"],
                   help="GPT (pretrain_gpt.py) or BERT (pretrain_bert.py)")
    g.add_argument("--loader", required=True, choices=["megatron", "hf", "mcore"],
                   help="what --load-dir holds: megatron (our --save directory), hf, or mcore "
                        "(a Megatron-LM --save directory in the torch_dist format)")
    g.add_argument("--saver", required=True, choices=["megatron", "hf", "mcore"],
                   help="what to write into --save-dir")
    g.add_argument("--load-dir", required=True)
    g.add_argument("--save-dir", required=True)
    g.add_argument("--hf-architecture", default="auto",
                   choices=["auto", "gpt2", "llama", "mixtral", "megatron-bert"],
                   help="export only: the transformers architecture (auto: BERT -> "
                        "megatron-bert, MoE -> mixtral, RoPE -> llama, else gpt2)")
    g.add_argument("--overwrite", action="store_true",
                   help="export: write config.json and model.safetensors into a --save-dir that "
                        "is not empty (its other files stay); import: replace an earlier "
                        "conversion in --save-dir (a training run's checkpoints never are). "
                        "Without it a non-empty export target, or an import target holding a "
                        "checkpoint, is refused before anything is read")
    t = p.add_argument_group("tokenizer (export: the tokenizer the data was tokenized with, "
                             "as for tools/preprocess_data.py; written next to the weights)")
    t.add_argument("--tokenizer-type", default=None, metavar="TYPE",
                   help="GPT2BPETokenizer, BertWordPiece(LowerCase|Case), (GPT)SentencePiece"
                        "Tokenizer or HuggingFaceTokenizer; default: no tokenizer files")
    t.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model ('embedded': the packaged one), or the "
                        "HuggingFaceTokenizer directory / tokenizer.json")
    t.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json or BERT vocab.txt")
    t.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    before = set(vars(p.parse_args(_REQUIRED)))
    add_model_args(p)  # import only: checked against the Hugging Face config
    p.set_defaults(**{dest: _UNSET for dest in set(vars(p.parse_args(_REQUIRED))) - before})
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_flag_warnings():
        return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    from megatron_auto.conversion.hf import (ConversionError, describe,  # noqa: PLC0415
                                             export_checkpoint, import_checkpoint,
                                             training_flags)
    from megatron_auto.conversion.hf_tokenizer import (TokenizerSpec,  # noqa: PLC0415
                                                       check_tokenizer_spec, export_tokenizer,
                                                       tokenizer_flags)
    from megatron_auto.families.registry import family_of  # noqa: PLC0415
    from megatron_auto.training.checkpoint import CheckpointError  # noqa: PLC0415
    from megatron_auto.training.logging import get_logger, setup_logging  # noqa: PLC0415

    setup_logging(0)
    log = get_logger()
    tokenizer_dests = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
    given = {k: v for k, v in vars(args).items() if v is not _UNSET and k not in (
        "model_type", "loader", "saver", "load_dir", "save_dir", "hf_architecture",
        "overwrite") + tokenizer_dests}
    tokenizer_given = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in tokenizer_dests
                       if getattr(args, k) is not None]
    try:
        if args.loader == args.saver:
            other = "megatron (our checkpoint format)" if args.loader == "hf" else "hf"
            raise ConversionError(f"--loader={args.loader} --saver={args.saver}: nothing to "
                                  f"convert; one of them must be {other}")
        model_type = args.model_type.lower()
        if "mcore" in (args.loader, args.saver):
            return _convert_mcore(args, given, tokenizer_given, model_type, log)
        if args.loader == "megatron":
            if given:
                raise ConversionError(f"--{next(iter(given)).replace('_', '-')}: model flags "
                                      f"apply to an import (--loader hf); an export takes the "
                                      f"model from the checkpoint, drop the flag")
            spec = None
            if args.tokenizer_type is not None:  # checked before anything is read
                spec = check_tokenizer_spec(TokenizerSpec(
                    args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file))
            elif tokenizer_given:
                raise ConversionError(f"{tokenizer_given[0]}: needs --tokenizer-type (the "
                                      f"tokenizer it belongs to); add it or drop the flag")
            arch, config = export_checkpoint(args.load_dir, args.save_dir, args.hf_architecture,
                                             model_type, overwrite=args.overwrite)
            log.info(f"> exported {describe(config)} to {args.save_dir} as {arch}")
            if spec is not None:
                kind = export_tokenizer(spec, args.save_dir, config.vocab_size)
                log.info(f"> wrote the {spec.tokenizer_type} tokenizer as transformers' {kind} "
                         f"(AutoTokenizer.from_pretrained({args.save_dir!r}))")
            else:
                log.info("> no tokenizer written (add --tokenizer-type and its files to "
                         "export the tokenizer with the weights)")
        else:
            if args.hf_architecture != "auto":
                warn_flag(f"--hf-architecture={args.hf_architecture}: applies to an export "
                          f"(--loader megatron); an import takes the architecture from the "
                          f"Hugging Face config.json")
            if tokenizer_given:
                warn_flag(f"{tokenizer_given[0]}: applies to an export (--loader megatron); an "
                          f"import reads the tokenizer files of --load-dir")
            spec = tokenizer_flags(args.load_dir, model_type)
            arch, config = import_checkpoint(args.load_dir, args.save_dir, given, model_type,
                                             overwrite=args.overwrite)
            script = family_of(config).entry_script
            log.info(f"> imported {arch} {args.load_dir} into {args.save_dir}: {describe(config)}")
            log.info(f"> train it with: {script} --load {args.save_dir} "
                     + " ".join(training_flags(config)))
            if spec is None:
                log.info(f"> {args.load_dir} has no tokenizer files: tokenize its data with the "
                         f"tokenizer the model was trained with")
            else:
                log.info(f"> its tokenizer, for tools/preprocess_data.py and with --data-path: "
                         + " ".join(spec.flags()))
    except (ConversionError, CheckpointError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _convert_mcore(args: argparse.Namespace, given: dict, tokenizer_given: list[str],
                   model_type: str, log) -> int:
    """Megatron-Core torch_dist <-> our checkpoint (megatron_auto/conversion/mcore.py)."""
    from megatron_auto.conversion.hf import ConversionError, describe, training_flags  # noqa
    from megatron_auto.conversion.mcore import export_mcore, import_mcore  # noqa: PLC0415

    if "megatron" not in (args.loader, args.saver):
        raise ConversionError(f"--loader={args.loader} --saver={args.saver}: Megatron-Core "
                              f"checkpoints convert to and from ours (megatron); convert in "
                              f"two steps through a megatron directory")
    if model_type != "gpt":
        raise ConversionError(f"--model-type={args.model_type}: Megatron-Core checkpoints "
                              f"convert for GPT / LLaMA models only; use GPT")
    if tokenizer_given:
        raise ConversionError(f"{tokenizer_given[0]}: tokenizer files go with a Hugging Face "
                              f"export (--saver hf); drop the flag")
    if args.hf_architecture != "auto":
        raise ConversionError(f"--hf-architecture={args.hf_architecture}: applies to a Hugging "
                              f"Face export (--saver hf); drop the flag")
    if args.loader == "mcore":
        config = import_mcore(args.load_dir, args.save_dir, given, overwrite=args.overwrite)
        log.info(f"> imported the Megatron-Core checkpoint {args.load_dir} into "
                 f"{args.save_dir}: {describe(config)}")
        log.info(f"> train it with: pretrain_gpt.py --load {args.save_dir} "
                 + " ".join(training_flags(config)))
        return 0
    if given:
        raise ConversionError(f"--{next(iter(given)).replace('_', '-')}: model flags apply to "
                              f"an import (--loader hf or mcore); an export takes the model "
                              f"from the checkpoint, drop the flag")
    path, config = export_mcore(args.load_dir, args.save_dir, overwrite=args.overwrite)
    log.info(f"> exported {describe(config)} to {path} (Megatron-Core torch_dist); load it "
             f"with Megatron-LM's --load {args.save_dir} --ckpt-format torch_dist "
             f"--no-load-optim --no-load-rng (weights only) and "
             + " ".join(training_flags(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
