"""Builds the example "your own target" of docs/your-own-model.md, offline.

    python scripts/example_target.py --out_dir runs/example [--train_steps 300]

Writes under OUT_DIR: text.txt (language-model text: the source of installed packages that are
not the Python standard library, numpy, scipy, jax, flax and optax by default), data.jsonl (one
{"prompt": signature + docstring, "completion": body} per documented function of the same
sources), tokenizer.json (a 6,000-id byte-level BPE trained on text.txt with the `tokenizers`
library, <unk>/<s>/</s> = 0/1/2), and target/ (a Llama of 4 x 256 pretrained on text.txt by
configs/experiments/example_target.gin; target/export is the Hugging Face directory to use as
TEACHER_CHECKPOINT). A rerun resumes the pretraining and rewrites nothing else.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random

from distillspec import console

PACKAGES = ("numpy", "scipy", "jax", "flax", "optax")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def package_files(names: tuple[str, ...], max_files: int) -> list[pathlib.Path]:
    """Non-test .py files of the installed packages `names`, in a stable shuffled order."""
    files = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"package {name!r} is not installed; choose others with --packages")
        for root in spec.submodule_search_locations:
            files += [p for p in pathlib.Path(root).rglob("*.py") if "test" not in str(p)]
    random.Random(0).shuffle(files)
    return sorted(files[:max_files])


def write_data(files: list[pathlib.Path], out_dir: pathlib.Path) -> None:
    """text.txt (blocks of up to 512 characters, blank-line separated) and data.jsonl."""
    from distillspec import corpus

    blocks, functions = [], []
    for path in files:
        try:
            source = corpus.read_source(path)
        except (UnicodeDecodeError, SyntaxError):
            continue
        lines = [x for x in corpus.split_lines(source) if x.strip()]  # No blank-line splits.
        blocks += [b.strip("\n") for b in corpus.chunk_lines(lines, 512) if b.strip()]
        functions += corpus.extract_functions(source, path.name)
    (out_dir / "text.txt").write_text("\n\n".join(blocks) + "\n")
    with open(out_dir / "data.jsonl", "w") as f:
        for ex in functions:
            f.write(json.dumps({"prompt": ex.prompt, "completion": ex.completion}) + "\n")
    print(
        f"[example] {len(blocks)} text blocks, {len(functions)} functions from {len(files)} files"
    )


def train_tokenizer(out_dir: pathlib.Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train([str(out_dir / "text.txt")], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default="runs/example")
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES))
    parser.add_argument("--max_files", type=int, default=400)
    parser.add_argument("--train_steps", type=int, default=300)
    args = parser.parse_args(argv)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / "tokenizer.json").is_file():
        write_data(package_files(tuple(args.packages), args.max_files), out_dir)
        train_tokenizer(out_dir, vocab_size=6000)
    from distillspec import gin_setup

    gin_setup.main("train", [
        "--gin_file=experiments/example_target.gin", f"--gin.MODEL_DIR={out_dir / 'target'}",
        f"--gin.TOKENIZER={out_dir / 'tokenizer.json'}",
        f"--gin.MIXTURE_OR_TASK_NAME={out_dir / 'text.txt'}",
        f"--gin.TRAIN_STEPS={args.train_steps}",
    ])  # fmt: skip


if __name__ == "__main__":
    console.quiet_startup()
    main()
