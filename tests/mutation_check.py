"""Plant known bugs in a copy of the repository and see which tests catch them.

    python tests/mutation_check.py                 # every mutation
    python tests/mutation_check.py attn-scale gqa  # some, by name
    python tests/mutation_check.py --list

Each mutation replaces one exact snippet (it must occur once) of one file in a throwaway copy of
the repository's tracked and untracked-but-not-ignored files, then runs the tests it names there
(in a fresh interpreter whose ``PYTHONPATH`` is the copy only). Tests that measure a deviation
write it as a JSON line to the file named by ``MEGATRON_AUTO_TEST_REPORT`` (see
:func:`report`); the table printed here is what the test docstrings quote. Nothing outside the
temporary directory is written. Not a test module (no ``test_`` prefix): it runs for minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPORT_ENV = "MEGATRON_AUTO_TEST_REPORT"


def report(**fields: object) -> None:
    """Append ``fields`` as one JSON line to the mutation report, when one is being collected."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(fields) + "\n")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments


REF = "tests/test_reference_equivalence.py"
T = "megatron_auto/models/transformer.py"
TP = "megatron_auto/parallel/tensor_parallel.py"
KILL = "tests/test_kill_during_save.py"
CK = "megatron_auto/training/checkpoint.py"
CENSUS = "tests/test_collective_count.py"
MUTATIONS = (
    Mutation("attn-scale", T, 'kwargs = {"enable_gqa": True} if self.heads_per_group > 1 else {}',
             'kwargs = {"enable_gqa": True} if self.heads_per_group > 1 else {}\n'
             '        kwargs["scale"] = 0.99 / self.head_dim ** 0.5', (REF,)),
    Mutation("attn-out", T, "return self.linear_proj(out)  #",
             "return 0.99 * self.linear_proj(out)  #", (REF,)),
    Mutation("mlp-out", T, "return self.linear_fc2(y)", "return 0.99 * self.linear_fc2(y)",
             (REF,)),
    Mutation("norm-eps", T, "return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)",
             "return nn.LayerNorm(config.hidden_size, eps=1.01 * config.layernorm_epsilon)",
             (REF, "-k", "gpt2 or bert")),
    Mutation("rmsnorm-eps", T,
             "return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)",
             "return nn.RMSNorm(config.hidden_size, eps=1.01 * config.layernorm_epsilon)",
             (REF, "-k", "llama")),
    Mutation("rope-base", T, "inv_freq = 1.0 / (base ** (", "inv_freq = 1.0 / ((1.01 * base) ** (",
             (REF, "-k", "llama")),
    Mutation("swiglu-gate", T, "y = F.silu(y[..., 0]) * y[..., 1]",
             "y = F.silu(y[..., 1]) * y[..., 0]", (REF, "-k", "llama")),
    Mutation("gqa-mapping", T,
             'kwargs = {"enable_gqa": True} if self.heads_per_group > 1 else {}',
             "kwargs, n = {}, self.heads_per_group\n"
             "        if n > 1:  # query head j -> key/value head j % g (wrong)\n"
             "            k, v = k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1)",
             (REF, "-k", "llama")),
    Mutation("gelu-tanh", T, 'self.gelu_approximate = "tanh" if config.openai_gelu else "none"',
             'self.gelu_approximate = "tanh"', (REF, "-k", "gpt2 or bert")),
    Mutation("column-bias-tp1", TP,
             "            return F.linear(x, self.weight, self.bias)\n"
             "        if self.sequence_parallel:",
             "            return F.linear(x, self.weight)\n"
             "        if self.sequence_parallel:", (REF, "-k", "gpt2 or bert")),
    Mutation("row-bias-tp", TP, "        return y if self.bias is None else y + self.bias\n",
             "        return y\n", (REF, "-k", "gpt2 or bert")),
    Mutation("position-embedding", "megatron_auto/models/gpt.py",
             "x = x + self.position_embeddings(position_ids)",
             "x = x + 0.99 * self.position_embeddings(position_ids)", (REF, "-k", "gpt2 or bert")),
    Mutation("tied-logits", "megatron_auto/models/gpt.py",
             "return F.linear(hidden, self.word_embeddings.weight)",
             "return 0.99 * F.linear(hidden, self.word_embeddings.weight)",
             (REF, "-k", "gpt2 or bert")),
    Mutation("mlm-bias", "megatron_auto/models/bert.py",
             "return embedding.logits(x) + self.bias  #", "return embedding.logits(x)  #",
             (REF, "-k", "bert")),
    Mutation("pooler-tanh", "megatron_auto/models/bert.py",
             "pooled = torch.tanh(self.pooler(hidden[:, 0]))",
             "pooled = self.pooler(hidden[:, 0])", (REF, "-k", "bert")),
    Mutation("latest-before-write", CK, "        os.makedirs(work)\n",
             "        os.makedirs(work)\n"
             "        atomic_write(os.path.join(save_dir, LATEST_FILE),"
             " f\"{trainer.iteration}\\n\")\n",
             (KILL, "-k", "sigkill")),
    Mutation("debris-kept", CK, "            if name.startswith(INCOMPLETE_PREFIX):",
             "            if False:", (KILL, "-k", "sigkill")),
    Mutation("rng-not-restored", CK,
             "    if same_plan:\n        _set_rng_state(trainer, {k: state[k] for k in rng})",
             "    if False:\n        _set_rng_state(trainer, {k: state[k] for k in rng})",
             (KILL,)),
    Mutation("initial-optimizer-state", CK,
             'if info.get("optimizer_state", True):', "if True:", (KILL, "-k", "train_iters")),
    # Collectives that change no number (so no equivalence test sees them), only the census.
    Mutation("ddp-bucket-twice", "megatron_auto/parallel/ddp_buckets.py",
             "            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM,",
             "            dist.all_reduce(torch.zeros_like(bucket.buffer), group=bucket.group)\n"
             "            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM,",
             (CENSUS, "-k", "every_collective and ddp-1f1b")),
    Mutation("grad-norm-twice", "megatron_auto/parallel/grad_norm.py",
             "        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)",
             "        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)\n"
             "        dist.all_reduce(torch.zeros_like(total), group=group)",
             (CENSUS, "-k", "every_collective and interleaved")),
    Mutation("tied-sync-twice", "megatron_auto/parallel/data_parallel.py",
             "            dist.all_reduce(local_tensor(param.grad), group=self.ctx.embedding_group)",
             "            dist.all_reduce(local_tensor(param.grad), group=self.ctx.embedding_group)\n"
             "            dist.all_reduce(torch.zeros(1), group=self.ctx.embedding_group)",
             (CENSUS, "-k", "every_collective and ddp-1f1b")),
    Mutation("nccl-missing-pair", "megatron_auto/planner/cost/gpu_terms.py",
             '        keys.add(("pair", j))', "        pass", ("tests/test_parallel_context_groups.py",)),
)


def _repository_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if (root / line).is_file()]


def run(mutation: Mutation, root: Path) -> dict:
    """Apply ``mutation`` in a copy of ``root``, run its tests; the outcome and reports."""
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        copy = Path(tmp) / "repo"
        for rel in _repository_files(root):
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, copy / rel)
        if mutation.path:  # the baseline changes nothing
            target = copy / mutation.path
            text = target.read_text(encoding="utf-8")
            count = text.count(mutation.old)
            if count != 1:
                raise SystemExit(f"{mutation.name}: the snippet occurs {count} times in "
                                 f"{mutation.path}; it must occur exactly once")
            target.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
        report_path = Path(tmp) / "report.jsonl"
        env = dict(os.environ, PYTHONPATH=str(copy), **{REPORT_ENV: str(report_path)})
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *mutation.tests], cwd=copy, env=env, capture_output=True,
                              text=True)
        lines = proc.stdout.strip().splitlines()
        reports = ([json.loads(line) for line in report_path.read_text().splitlines()]
                   if report_path.exists() else [])
        return {"name": mutation.name, "caught": proc.returncode != 0,
                "summary": lines[-1] if lines else proc.stderr[-300:], "reports": reports}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--baseline", action="store_true",
                        help="first run the mutations' tests unchanged (their own deviations)")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:20s} {m.path}: {m.old.strip().splitlines()[0]}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; --list shows them")
    root = Path(__file__).resolve().parent.parent
    chosen = [by_name[n] for n in args.names or list(by_name)]
    if args.baseline:
        tests = tuple(dict.fromkeys(m.tests[0] for m in chosen))
        chosen.insert(0, Mutation("baseline", "", "", "", tests))
    missed = 0
    for mutation in chosen:
        result = run(mutation, root)
        name = mutation.name
        if name == "baseline":
            result["caught"] = not result["caught"]  # the baseline must pass
        missed += not result["caught"]
        worst: dict[str, float] = {}
        for rep in result["reports"]:
            for key, value in rep.items():
                if isinstance(value, float):
                    worst[key] = max(worst.get(key, 0.0), value)
        figures = ", ".join(f"max {k} {v:.2g}" for k, v in sorted(worst.items()))
        verdict = ("passes" if result["caught"] else "FAILS") if name == "baseline" else (
            "caught" if result["caught"] else "MISSED")
        print(f"{name:20s} {verdict}: {result['summary']}"
              f"{'; ' + figures if figures else ''}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
