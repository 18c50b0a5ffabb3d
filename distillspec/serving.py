"""Serving a draft beside its target: what vLLM, SGLang and transformers need of the export,
checked on its files (`check`), and the command that serves it in each (`commands`).

The engines and what they are given (docs/serving.md cites the engines' docs):
  * vLLM, `vllm serve TARGET --speculative-config '{"method": "draft_model", "model": DRAFT,
    "num_speculative_tokens": k}'`: an architecture vLLM implements (T5 is not one), the
    target's vocab_size exactly (no padding), the target's tokenizer, and config.json,
    safetensors and tokenizer files in the draft's directory;
  * SGLang, `--speculative-algorithm STANDALONE --speculative-draft-model-path DRAFT` with
    `--speculative-num-steps k --speculative-eagle-topk 1 --speculative-num-draft-tokens k+1`
    (a chain of k drafts): likewise, and it rejects a vocabulary that differs from the target's;
  * transformers, `target.generate(..., assistant_model=draft)`: one family (both decoder-only
    or both encoder-decoder) and one vocab_size (else it asks for two tokenizers).
Every engine needs weights that load: each tensor present with the shape config.json implies,
finite values, a stored dtype the engines read, embeddings tied as the config says, and the
special-token ids of the target (a draft that stops on another EOS drafts past the end).

Nothing here imports TensorFlow or seqio, so `python -m distillspec.serve_check` starts fast;
the weights are read once, through the loaders' own reader (`safetensors_files`), which also
refuses non-finite values and truncated files (`models.weight_checks`).
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distillspec import tokenizer_files

ENGINES = ("vllm", "sglang", "transformers")
ENGINE_NAMES = {
    "vllm": "vLLM (draft_model)",
    "sglang": "SGLang (STANDALONE)",
    "transformers": "transformers (assisted generation)",
}
# The architectures each engine implements, among those distillspec exports (hf_interop).
DECODER_ONLY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
ARCHITECTURES = {
    "vllm": DECODER_ONLY,
    "sglang": DECODER_ONLY,
    "transformers": (*DECODER_ONLY, "T5ForConditionalGeneration"),
}
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # What all three read.
NEEDS_TOKENIZER_FILES = ("vllm", "sglang")  # Load the draft directory as a model of its own.
SERVING_FILE = "SERVING.md"  # Written next to the export's weights.
_GAMMA_MARK = "<!-- distillspec-serving "  # SERVING.md's machine-readable line: γ and source.
NOTES = (
    "vLLM's CPU back end does not run draft-model speculation: serve on a GPU.",
    "TPU (vllm-project/tpu-inference) has n-gram, EAGLE-3, MTP and DFlash proposers but no "
    "draft_model: a standalone draft does not serve there.",
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One unmet condition and the engines it blocks."""

    check: str  # What was checked: 'architecture', 'vocabulary', 'tokenizer', 'files', ...
    message: str  # What is wrong, naming the value and what would be valid.
    engines: tuple[str, ...] = ENGINES


def _read_config(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        return tokenizer_files.read_json(path)
    except ValueError:
        return None


def _architecture(config: Mapping[str, Any]) -> str:
    return (config.get("architectures") or [f"(model_type {config.get('model_type')!r})"])[0]


def _model_problems(draft: dict, target: dict | None) -> list[Problem]:
    """Architecture per engine, family and vocabulary size against the target."""
    problems = []
    arch = _architecture(draft)
    for engine in ENGINES:
        if arch not in ARCHITECTURES[engine]:
            problems.append(Problem(
                "architecture",
                f"{arch} is not an architecture {ENGINE_NAMES[engine]} serves as a draft; it "
                f"serves {', '.join(ARCHITECTURES[engine])}",
                (engine,),
            ))  # fmt: skip
    if target is None:
        return problems
    families = [
        bool(c.get("is_encoder_decoder", c.get("model_type") == "t5")) for c in (draft, target)
    ]
    if families[0] != families[1]:
        kinds = ["encoder-decoder" if f else "decoder-only" for f in families]
        problems.append(Problem(
            "architecture", f"the draft is {kinds[0]} but the target is {kinds[1]}",
        ))  # fmt: skip
    sizes = draft.get("vocab_size"), target.get("vocab_size")
    if sizes[0] != sizes[1]:
        problems.append(Problem(
            "vocabulary",
            f"vocab_size {sizes[0]} differs from the target's {sizes[1]}: the engines need the "
            "same size (vLLM accepts no padding; transformers would ask for two tokenizers)",
        ))  # fmt: skip
    return problems


def _tokenizer_problems(draft_dir: str, target_dir: str | None) -> list[Problem]:
    """Tokenizer files present; the same vocabulary and special-token ids as the target's."""
    problems = []
    draft_file = tokenizer_files.tokenizer_file(draft_dir)
    if draft_file is None:
        problems.append(Problem(
            "tokenizer files",
            f"{draft_dir} holds no tokenizer file (one of "
            f"{', '.join(tokenizer_files.TOKENIZER_FILES)}); copy the target's next to the weights",
            NEEDS_TOKENIZER_FILES,
        ))  # fmt: skip
    if target_dir is None:
        return problems
    target_file = tokenizer_files.tokenizer_file(target_dir)
    if draft_file and target_file and not filecmp.cmp(draft_file, target_file, shallow=False):
        ours, theirs = map(tokenizer_files.token_strings, (draft_file, target_file))
        if ours != theirs:
            agree = sum(a == b for a, b in zip(ours, theirs))
            problems.append(Problem(
                "tokenizer",
                f"{draft_file} ({len(ours)} ids) is not the target's {target_file} "
                f"({len(theirs)} ids): only {agree} ids give the same token",
            ))  # fmt: skip
    ids = [tokenizer_files.checkpoint_special_ids(d) for d in (draft_dir, target_dir)]
    for key in ("bos", "eos", "pad"):
        mine, theirs = ids[0][key], ids[1][key]
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(Problem(
                "special tokens",
                f"{key}_token_id is {mine} but the target's is {theirs} (config.json / "
                "generation_config.json): the draft must stop where the target stops",
            ))  # fmt: skip
    return problems


def _names(config: Mapping[str, Any], tensors: Iterable[str]) -> dict[str, str]:
    """{name as `from_pretrained` reads it: name in the file} (GPT2Model exports drop the
    'transformer.' prefix; GPT-2's lm_head is wte's copy)."""
    if config.get("model_type") != "gpt2":
        return {name: name for name in tensors}
    out = {}
    for name in tensors:
        if name != "lm_head.weight":
            out[name if name.startswith("transformer.") else f"transformer.{name}"] = name
    return out


def _tied_problems(config: Mapping[str, Any], tensors, values: bool) -> list[Problem]:
    """tie_word_embeddings against the lm_head the file holds (Llama / Qwen2 layouts)."""
    if config.get("model_type") not in ("llama", "qwen2"):
        return []
    tied = bool(config.get("tie_word_embeddings", False))
    has_head = "lm_head.weight" in tensors
    if not tied and not has_head:
        return [Problem(
            "tied embeddings",
            "config.json says tie_word_embeddings=false but the weights hold no lm_head.weight: "
            "set it to true (the head is the embedding) or export the head",
        )]  # fmt: skip
    if tied and has_head:
        try:
            head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
            same = values and head.shape == embed.shape and (head == embed).all()
        except (KeyError, ValueError):  # Non-finite or absent: reported by the other checks.
            same = False
        if not same:
            return [Problem(
                "tied embeddings",
                "config.json says tie_word_embeddings=true but the weights hold an lm_head.weight "
                "unlike model.embed_tokens.weight; the engines would ignore it and use the "
                "embedding: set tie_word_embeddings=false",
            )]  # fmt: skip
    return []


def _dtype_problems(config: Mapping[str, Any], tensors) -> list[Problem]:
    stored = {tensors.dtype(name) for name in tensors}
    odd = sorted(stored - set(STORED_DTYPES))
    problems = []
    if odd:
        problems.append(Problem(
            "dtype", f"tensors stored as {odd}; the engines read {sorted(STORED_DTYPES)}",
        ))  # fmt: skip
    stated = config.get("torch_dtype") or config.get("dtype")
    floats = {STORED_DTYPES[d] for d in stored if d in STORED_DTYPES}
    if len(floats) > 1:
        problems.append(Problem("dtype", f"tensors mix dtypes {sorted(floats)}; store one"))
    elif stated and floats and stated not in floats:
        problems.append(Problem(
            "dtype",
            f"config.json says dtype {stated!r} but the tensors are {floats.pop()}: vLLM's and "
            "SGLang's dtype=auto read the config; make it say what is stored",
            ("vllm", "sglang"),
        ))  # fmt: skip
    return problems


def _weight_problems(draft_dir: str, config: dict, values: bool) -> list[Problem]:
    """Files present and loadable: headers, tensor names and shapes against config.json,
    stored dtypes, tied embeddings, finite values."""
    from distillspec.models import loading, safetensors_files, weight_checks

    try:
        tensors = safetensors_files.read_tensors(draft_dir)
    except (FileNotFoundError, weight_checks.CheckpointError) as e:
        return [Problem("files", str(e))]
    names = _names(config, tensors)
    try:
        expected = loading.expected_hf_tensors(config, set(names))
    except (ValueError, KeyError, TypeError) as e:
        return [
            Problem("files", f"config.json does not describe a model distillspec can check: {e!r}")
        ]
    problems = _dtype_problems(config, tensors) + _tied_problems(config, tensors, values)
    missing = sorted(set(expected) - set(names))
    unexpected = sorted(n for n in set(names) - set(expected) if not loading.ignored_tensor(n))
    wrong = [
        f"{n}: {tensors.shape(names[n])} (config.json implies {expected[n]})"
        for n in sorted(set(expected) & set(names))
        if tensors.shape(names[n]) != expected[n]
    ]
    if config.get("tie_word_embeddings"):  # A head beside a tied embedding: the tied check's.
        unexpected = [n for n in unexpected if n != "lm_head.weight"]
    for what, items in (("missing", missing), ("unexpected", unexpected), ("misshapen", wrong)):
        if items:
            shown = ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
            problems.append(Problem("files", f"{len(items)} tensors {what}: {shown}"))
    for name in tensors if values else ():
        try:
            tensors[name]
        except weight_checks.CheckpointError as e:
            problems.append(Problem("values", str(e)))
    return problems


def check(
    draft_dir: str, target_dir: str | None, engines: Sequence[str] = ENGINES, values: bool = True
) -> dict[str, Any]:
    """Whether `draft_dir` (a Hugging Face directory) serves beside `target_dir` in each engine.

    Args:
      draft_dir: the draft's export.
      target_dir: the target's Hugging Face directory; None checks the draft on its own.
      engines: which of ENGINES to report.
      values: read every tensor and check it is finite (the rest reads headers only).

    Returns:
      {'draft', 'target', 'ready' (every engine asked), 'engines': {engine: {'ready',
      'problems': ['check: message', ...]}}, 'notes'}.
    """
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; valid: {', '.join(ENGINES)} (or all)")
    problems = _all_problems(draft_dir, target_dir, values)
    report = {
        engine: {
            "ready": not (
                mine := [f"{p.check}: {p.message}" for p in problems if engine in p.engines]
            ),
            "problems": mine,
        }
        for engine in engines
    }
    ready = all(r["ready"] for r in report.values())
    return {"draft": draft_dir, "target": target_dir, "ready": ready, "engines": report,
            "notes": list(NOTES)}  # fmt: skip


def _all_problems(draft_dir: str, target_dir: str | None, values: bool) -> list[Problem]:
    if not os.path.isdir(draft_dir):
        return [Problem("files", f"{draft_dir!r} is not a directory")]
    draft = _read_config(draft_dir)
    if draft is None:
        return [Problem("files", f"{draft_dir} has no readable config.json")]
    target = None
    problems = []
    if target_dir is not None:
        target = _read_config(target_dir)
        if target is None:
            problems.append(Problem("target", f"{target_dir} has no readable config.json"))
    problems += _model_problems(draft, target)
    problems += _tokenizer_problems(draft_dir, target_dir if target is not None else None)
    return problems + _weight_problems(draft_dir, draft, values)


# The commands. -----------------------------------------------------------------------------------


def commands(draft_dir: str, target: str, gamma: int, seq2seq: bool = False) -> dict[str, str]:
    """{engine: the command (or Python, for transformers) serving `draft_dir` beside `target`
    with `gamma` drafts per round}."""
    q = shlex.quote
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": gamma}
    auto = "AutoModelForSeq2SeqLM" if seq2seq else "AutoModelForCausalLM"
    return {
        "vllm": f"vllm serve {q(target)} --speculative-config {q(json.dumps(spec))}",
        "sglang": (
            f"python -m sglang.launch_server --model-path {q(target)} "
            f"--speculative-algorithm STANDALONE --speculative-draft-model-path {q(draft_dir)} "
            f"--speculative-num-steps {gamma} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {gamma + 1}"
        ),
        "transformers": (
            f"from transformers import {auto}, AutoTokenizer\n"
            f"tokenizer = AutoTokenizer.from_pretrained({target!r})\n"
            f"target = {auto}.from_pretrained({target!r})\n"
            f"draft = {auto}.from_pretrained({draft_dir!r})\n"
            'inputs = tokenizer("def add(a, b):", return_tensors="pt")\n'
            "output = target.generate(**inputs, assistant_model=draft, "
            f'num_assistant_tokens={gamma}, num_assistant_tokens_schedule="constant", '
            "do_sample=False, max_new_tokens=64)"
        ),
    }


def best_gamma(records: Iterable[Mapping[str, Any]], draft: str) -> int | None:
    """The γ of the draft's best batch-1 latency speed-up (mean over eval sets and
    temperatures) in an evaluation's grid records; None when none measured it."""
    by_gamma: dict[int, list[float]] = {}
    for r in records:
        if r.get("draft") == draft and "policy" not in r and r.get("latency_speedup") is not None:
            by_gamma.setdefault(int(r["gamma"]), []).append(float(r["latency_speedup"]))
    if not by_gamma:
        return None
    return max(sorted(by_gamma), key=lambda g: sum(by_gamma[g]) / len(by_gamma[g]))


def serving_gamma(
    measured: int | None, plan: int | None, recipe: int | None, export_dir: str | None = None
) -> tuple[int, str]:
    """(γ, where it came from): the evaluation's best batch-1 γ, else the plan's, else what an
    earlier SERVING.md in export_dir says, else the recipe's, else 5."""
    if measured is not None:
        return measured, "the evaluation's best batch-1 latency speed-up"
    if plan is not None:
        return plan, "the plan's (python -m distillspec.plan)"
    earlier = read_serving_gamma(export_dir) if export_dir else None
    if earlier is not None:
        return earlier
    if recipe is not None:
        return recipe, "the recipe's (EvalConfig.gamma)"
    return 5, "a default (nothing measured or planned)"


def read_serving_gamma(export_dir: str) -> tuple[int, str] | None:
    """The (γ, source) an export's SERVING.md states, or None."""
    path = os.path.join(export_dir, SERVING_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith(_GAMMA_MARK):
                stated = json.loads(line[len(_GAMMA_MARK) : line.rindex("-->")])
                return int(stated["gamma"]), str(stated["source"])
    return None


def _paths(report: Mapping[str, Any]) -> tuple[str, str]:
    """The draft's and the target's directories as absolute paths ('TARGET' when unknown)."""
    target = report["target"]
    return os.path.abspath(report["draft"]), os.path.abspath(target) if target else "TARGET"


def serving_text(report: Mapping[str, Any], gamma: int, source: str) -> str:
    """SERVING.md: per engine, ready or not (the conditions unmet) and the command."""
    draft, target = _paths(report)
    cmds = commands(draft, target, gamma, seq2seq=_is_seq2seq(draft))
    lines = [
        "# Serving this draft", "",
        f"Written by distillspec (`python -m distillspec.serve_check {shlex.quote(draft)} "
        f"--target {shlex.quote(target)}` checks it again). γ = {gamma}: {source}.",
        f"{_GAMMA_MARK}{json.dumps({'gamma': gamma, 'source': source})} -->", "",
    ]  # fmt: skip
    for engine, result in report["engines"].items():
        lines.append(f"## {ENGINE_NAMES[engine]}: {'ready' if result['ready'] else 'not ready'}\n")
        if result["ready"]:
            fence = "python" if engine == "transformers" else "bash"
            lines += [f"```{fence}", cmds[engine], "```", ""]
        else:
            lines += [f"- {p}" for p in result["problems"]] + [""]
    lines += ["Notes:", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


def _is_seq2seq(directory: str) -> bool:
    config = _read_config(directory) or {}
    return bool(config.get("is_encoder_decoder", config.get("model_type") == "t5"))


def write_serving(report: Mapping[str, Any], gamma: int, source: str, directory: str) -> str:
    """Writes `serving_text` to directory/SERVING.md; returns its path."""
    path = os.path.join(directory, SERVING_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(serving_text(report, gamma, source))
    return path


def summary(report: Mapping[str, Any], gamma: int, source: str) -> str:
    """The terminal's lines: each engine ready or not, the ready engines' commands."""
    draft, target = _paths(report)
    cmds = commands(draft, target, gamma, seq2seq=_is_seq2seq(draft))
    lines = [f"Serve {draft} beside {target} (γ = {gamma}: {source}):"]
    for engine, result in report["engines"].items():
        if result["ready"]:
            command = cmds[engine].replace("\n", "\n    ")
            lines.append(f"  {engine}: ready\n    {command}")
        else:
            lines.append(f"  {engine}: not ready")
            lines += [f"    - {p}" for p in result["problems"]]
    return "\n".join(lines)
