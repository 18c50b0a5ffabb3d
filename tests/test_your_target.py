"""Your own target end to end from the command line (issue: tokenizer, special tokens, data,
a draft sized for it, a servable export, and no silent wrong numbers).

A module fixture builds, offline: a tiny random Llama with a BPE `tokenizer.json` made by the
`tokenizers` library (BOS added by its post-processor, EOS 2), a Qwen2 pair sharing that
tokenizer with embeddings padded to different sizes, a tiny T5 with a SentencePiece model, and
small JSONL data. Everything runs through `gin_setup.main` (the CLIs' function) with gin flags.
"""

from __future__ import annotations

import json
import pathlib

import gin
import numpy as np
import pytest

from distillspec import gin_setup, tasks, vocabularies
from distillspec.feature_converters import prompt_batches

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CODE = [
    "def add(a, b):\n    return a + b\n",
    "def mul(a, b):\n    return a * b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "if x > 0:\n    y = x\nelse:\n    y = -x\n",
] * 8
LLAMA = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def _bpe_tokenizer(path: pathlib.Path) -> int:
    """A BPE tokenizer.json with <unk>=0, <s>=1, </s>=2 and BOS added by its post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CODE, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def _save(model, path: pathlib.Path, tokenizer_from: pathlib.Path | None = None):
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "spiece.model"):
        if tokenizer_from is not None and (tokenizer_from / name).is_file():
            (path / name).write_bytes((tokenizer_from / name).read_bytes())
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("your_target")
    tok_dir = root / "tok"
    tok_dir.mkdir()
    size = _bpe_tokenizer(tok_dir)
    torch.manual_seed(0)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=size, initializer_range=0.5, **LLAMA, **ids)
    )
    qwen = lambda pad: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(vocab_size=size + pad, num_key_value_heads=2, **LLAMA, **ids)
    )  # fmt: skip
    data = root / "data"
    data.mkdir()
    for split, rows in (("train", CODE[:30]), ("test", CODE[30:])):
        lines = [json.dumps({"prompt": c[:12], "completion": c[12:]}) for c in rows]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    prompts_only = root / "prompts.jsonl"
    prompts_only.write_text("".join(json.dumps({"prompt": c[:12]}) + "\n" for c in CODE))
    return {
        "root": root, "tok": tok_dir, "size": size, "data": str(data),
        "prompts_only": str(prompts_only),
        "llama": _save(llama, root / "llama", tok_dir),
        "qwen_a": _save(qwen(4), root / "qwen_a", tok_dir),
        "qwen_b": _save(qwen(12), root / "qwen_b", tok_dir),
    }  # fmt: skip


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


DISTILL = [
    "--gin_file=runs/distill.gin", "--gin.TRAIN_STEPS=2", "--gin.BATCH_SIZE=2",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 6}", "--gin.STUDENT_CHECKPOINT=None",
    "--gin.LoopConfig.checkpoint_period=2",
]  # fmt: skip


def _distill(model_dir, teacher, task, *extra):
    return gin_setup.main(
        "train",
        [*DISTILL, f"--gin.MODEL_DIR={model_dir}", f"--gin.TEACHER_CHECKPOINT={teacher}",
         f"--gin.MIXTURE_OR_TASK_NAME={task}", *extra],
    )  # fmt: skip


def test_builtin_tokenizer_has_no_bos():
    """SentencePiece says -1 for "no BOS"; an export must not write bos_token_id = -1."""
    tok = vocabularies.load_tokenizer("sentencepiece")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 1, 0)
    assert tok.special_ids == {"bos": None, "eos": 1, "pad": 0}


def test_builtin_tokenizer_exports_for_auto_tokenizer(tmp_path):
    """The embedded default's export loads with AutoTokenizer and gives our ids."""
    tok = vocabularies.load_tokenizer("sentencepiece")
    assert tok.save(str(tmp_path)) == ["tokenizer.model", "tokenizer_config.json"]
    assert "bos_token" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["def add(a, b):\n    return a + b\n", "    if x:\n\tpass", "class A:  # x"]:
        assert hf(text).input_ids == tok.vocabulary.encode(text)


def test_tokenizer_from_the_checkpoint(world):
    tok = vocabularies.load_tokenizer(None, world["llama"])
    assert tok.source.endswith("tokenizer.json") and tok.size == world["size"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (1, 2, 0, True)
    assert "EOS 2, BOS 1 prepended" in tok.describe()
    name = tasks.register_task(world["data"], tok.vocabulary, bos_id=tok.prompt_bos)
    batch = next(prompt_batches(name, "train", 4, 32, 6, shuffle=False))
    assert (batch["prompt_tokens"][:, 0] == 1).all()  # BOS first, as the post-processor does.
    ends = batch["completion_tokens"][np.arange(4), batch["completion_lengths"] - 1]
    assert (ends[batch["completion_lengths"] < 6] == 2).all()  # Completions end with EOS 2.
    # Prompts cut from the left keep their BOS (and the tokens nearest the completion).
    short = next(prompt_batches(name, "train", 4, 3, 6, shuffle=False, bos_id=1))
    assert (short["prompt_tokens"][:, 0] == 1).all()
    full = batch["prompt_tokens"][np.arange(4), batch["prompt_lengths"] - 1]
    np.testing.assert_array_equal(short["prompt_tokens"][:, 2], full)


@pytest.fixture(scope="module")
def drafts(world, tmp_path_factory):
    """A fresh draft and an early-exit draft for the Llama target, distilled on the JSONL."""
    out = tmp_path_factory.mktemp("drafts")
    gin.clear_config()
    fresh = ["--gin.train.student=@DraftSpec()", "--gin.DraftSpec.num_layers=1",
             "--gin.DraftSpec.embed_dim=16", "--gin.DraftSpec.mlp_dim=32"]  # fmt: skip
    _distill(out / "fresh", world["llama"], world["data"], *fresh)
    gin.clear_config()
    early = ["--gin.train.student=@DraftSpec()", "--gin.DraftSpec.from_target_layers=1"]
    _distill(out / "early", world["llama"], world["prompts_only"], *early)
    gin.clear_config()
    return {name: str(out / name / "export") for name in ("fresh", "early")}


def test_drafts_are_servable_with_transformers(world, drafts):
    target_tok = transformers.AutoTokenizer.from_pretrained(world["llama"])
    target = transformers.AutoModelForCausalLM.from_pretrained(world["llama"])
    for path in drafts.values():
        export = pathlib.Path(path)
        config = json.loads((export / "config.json").read_text())
        generation = json.loads((export / "generation_config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
        assert generation["eos_token_id"] == 2
        tok = transformers.AutoTokenizer.from_pretrained(path)
        text = "def add(a, b):"
        assert tok(text).input_ids == target_tok(text).input_ids
        draft = transformers.AutoModelForCausalLM.from_pretrained(path)
        ids = tok(text, return_tensors="pt").input_ids
        plain = target.generate(ids, max_new_tokens=6, do_sample=False)
        assisted = target.generate(ids, assistant_model=draft, max_new_tokens=6, do_sample=False)
        assert torch.equal(plain, assisted)  # Assisted greedy decoding is exact.
    early = json.loads((pathlib.Path(drafts["early"]) / "config.json").read_text())
    assert early["num_hidden_layers"] == 1 and early["hidden_size"] == 32


def test_evaluate_your_target_with_its_tokenizer(world, drafts, tmp_path):
    made = gin_setup.main("evaluate", [
        "--gin_file=runs/evaluate.gin", f"--gin.OUTPUT_DIR={tmp_path}",
        f"--gin.TARGET_CHECKPOINT={world['llama']}", f"--gin.DRAFTS={json.dumps(drafts)}",
        f"--gin.EVAL_SETS=[({world['data']!r}, 'test')]", "--gin.GAMMAS=[2]",
        "--gin.TEMPERATURES=[0.0]", "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 6}",
        "--gin.NUM_PROMPTS=4", "--gin.evaluate.batch_size=4",
    ])  # fmt: skip
    assert {r["draft"] for r in made} == {"fresh", "early"}
    assert all(0.0 <= r["alpha"] <= 1.0 and r["num_prompts"] == 4 for r in made)
    assert all(r["task"].startswith("file:data#") for r in made)


def test_padded_vocabularies_need_vocab_size(world, tmp_path):
    flags = [
        "--gin_file=runs/evaluate.gin", f"--gin.OUTPUT_DIR={tmp_path}",
        f"--gin.TARGET_CHECKPOINT={world['qwen_b']}",
        f"--gin.DRAFTS={json.dumps({'a': world['qwen_a']})}",
        f"--gin.EVAL_SETS=[({world['data']!r}, 'test')]", "--gin.GAMMAS=[2]",
        "--gin.TEMPERATURES=[1.0]", "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 4}",
        "--gin.NUM_PROMPTS=2", "--gin.evaluate.batch_size=2",
    ]  # fmt: skip
    sizes = rf"'target': {world['size'] + 12}, 'a': {world['size'] + 4}.*evaluate\.vocab_size"
    with pytest.raises(ValueError, match=sizes):
        gin_setup.main("evaluate", flags)
    gin.clear_config()
    (record,) = gin_setup.main("evaluate", [*flags, f"--gin.evaluate.vocab_size={world['size']}"])
    assert 0.0 <= record["alpha"] <= 1.0
    # Distillation over the shared ids; the draft keeps its own padded embedding.
    gin.clear_config()
    with pytest.raises(ValueError, match=r"train\.vocab_size"):
        _distill(
            tmp_path / "d0",
            world["qwen_b"],
            world["data"],
            f"--gin.STUDENT_CHECKPOINT={world['qwen_a']}",
        )
    gin.clear_config()
    student = f"--gin.STUDENT_CHECKPOINT={world['qwen_a']}"
    _distill(tmp_path / "d", world["qwen_b"], world["data"], student,
             f"--gin.train.vocab_size={world['size']}")  # fmt: skip
    config = json.loads((tmp_path / "d" / "export" / "config.json").read_text())
    assert config["vocab_size"] == world["size"] + 4


def _copy(source: str, destination: pathlib.Path, **config_changes) -> str:
    """A copy of a checkpoint directory with config.json keys changed (None removes one)."""
    if not destination.exists():
        destination.mkdir()
        for f in pathlib.Path(source).iterdir():
            if f.name != "generation_config.json":
                (destination / f.name).write_bytes(f.read_bytes())
        config = json.loads((destination / "config.json").read_text())
        config.update(config_changes)
        config = {k: v for k, v in config.items() if v is not None}
        (destination / "config.json").write_text(json.dumps(config))
    return str(destination)


def test_the_mismatch_that_printed_alpha_one_now_stops(world, drafts, tmp_path):
    """The built-in 2,048-id vocabulary against a 300-id target: ids past its embedding."""
    flags = [
        "--gin_file=runs/evaluate.gin", f"--gin.OUTPUT_DIR={tmp_path}",
        f"--gin.DRAFTS={json.dumps(drafts)}", "--gin.evaluate.vocabulary='sentencepiece'",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"eos_token_id=2, but the vocabulary 'sentencepiece'"):
        gin_setup.main("evaluate", [*flags, f"--gin.TARGET_CHECKPOINT={world['llama']}"])
    # Without special ids in the target's config, the embedding sizes still stop it.
    bare = _copy(world["llama"], world["root"] / "llama_bare", bos_token_id=None,
                 eos_token_id=None, pad_token_id=None)  # fmt: skip
    bare_drafts = {n: _copy(p, tmp_path / n, bos_token_id=None, eos_token_id=None,
                            pad_token_id=None) for n, p in drafts.items()}  # fmt: skip
    gin.clear_config()
    flags[2] = f"--gin.DRAFTS={json.dumps(bare_drafts)}"
    with pytest.raises(ValueError, match=r"2048 ids but the embedding of .*'target': 300"):
        gin_setup.main("evaluate", [*flags, f"--gin.TARGET_CHECKPOINT={bare}"])


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown_task", r"unknown task 'nope'; built-in tasks: stdlib_code"),
        ("missing_tokenizer", r"neither a built-in name nor a file"),
        ("unreadable_tokenizer", r"cannot read the tokenizer"),
        ("prompts_only_lambda1", r"prompts only .*\(lambda1\) = 1.0 must be 0"),
        ("missing_key", r"train.jsonl:2 has no string under the prompt key 'prompt'"),
        ("empty_file", r"holds no examples"),
        ("special_tokens", r"disagree on eos_token_id"),
    ],
)
def test_bad_input_fails_before_work(world, tmp_path, case, message):
    extra, task, teacher = [], world["data"], world["llama"]
    if case == "unknown_task":
        task = "nope"
    elif case == "missing_tokenizer":
        extra = [f"--gin.train.vocabulary={tmp_path / 'none.json'}"]
    elif case == "unreadable_tokenizer":
        (tmp_path / "bad.json").write_text("{not json")
        extra = [f"--gin.train.vocabulary={tmp_path / 'bad.json'}"]
    elif case == "prompts_only_lambda1":
        task, extra = world["prompts_only"], ["--gin.LAMBDA1=1.0"]
    elif case in ("missing_key", "empty_file"):
        (tmp_path / "d").mkdir()
        text = '{"prompt": "a", "completion": "b"}\n{"question": "c"}\n'
        (tmp_path / "d" / "train.jsonl").write_text(text if case == "missing_key" else "")
        task = str(tmp_path / "d")
    elif case == "special_tokens":
        student = _copy(world["llama"], world["root"] / "llama_eos3", eos_token_id=3)
        extra = [f"--gin.STUDENT_CHECKPOINT={student}"]
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        _distill(tmp_path / "run", teacher, task, "--gin.train.student=None", *extra)
    assert not (tmp_path / "run" / "checkpoints").exists()  # Nothing trained.


@pytest.fixture(scope="module")
def t5_target(world):
    """A tiny T5 v1.1 with a unigram SentencePiece spiece.model (pad 0, EOS 1, UNK 2), as T5
    ships (Hugging Face converts unigram models exactly; BPE ones it may split otherwise)."""
    import io

    import sentencepiece as spm

    path = world["root"] / "t5"
    path.mkdir()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CODE), model_writer=model, vocab_size=48, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    (path / "spiece.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
    )  # fmt: skip
    hf.save_pretrained(path)
    return str(path)


def test_t5_target_with_its_sentencepiece_model(world, t5_target, tmp_path):
    tok = vocabularies.load_tokenizer(None, t5_target)
    assert tok.source.endswith("spiece.model") and (tok.eos_id, tok.add_bos) == (1, False)
    name = tasks.register_task(world["data"], tok.vocabulary, inputs_eos=True)
    batch = next(prompt_batches(name, "train", 4, 32, 6, shuffle=False))
    last = batch["prompt_tokens"][np.arange(4), batch["prompt_lengths"] - 1]
    assert (last == 1).all()  # The encoder's input ends with EOS, as T5 was trained.
    early = ["--gin.train.student=@DraftSpec()", "--gin.DraftSpec.from_target_layers=1"]
    _distill(tmp_path / "run", t5_target, world["data"], *early)
    export = tmp_path / "run" / "export"
    assert json.loads((export / "config.json").read_text())["num_layers"] == 1
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 1
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    text = "def add(a, b):"
    assert hf_tok(text, add_special_tokens=False).input_ids == tok.vocabulary.encode(text)
    transformers.AutoModelForSeq2SeqLM.from_pretrained(export)  # Loads as a T5 model.


def test_gpt2_draft_keeps_the_targets_eos(world, tmp_path):
    """A GPT-2 export used to fall back to transformers' default EOS 50256."""
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=world["size"], n_positions=64, n_embd=32, n_layer=2, n_head=4,
            bos_token_id=1, eos_token_id=2,
        )
    )  # fmt: skip
    target = _save(gpt2, world["root"] / "gpt2", world["tok"])
    fresh = ["--gin.train.student=@DraftSpec()", "--gin.DraftSpec.num_layers=1"]
    _distill(tmp_path / "run", target, world["data"], *fresh)
    export = str(tmp_path / "run" / "export")
    draft = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert draft.config.model_type == "gpt2" and draft.generation_config.eos_token_id == 2
    # Its width is chosen for the target (at most 1/10 of its parameters), not the target's 32.
    assert draft.config.n_layer == 1 and draft.config.n_embd < 32
