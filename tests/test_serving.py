"""Serving a draft (issue 55): the serve check per engine on planted defects, the printed serve
commands against the engines' documented syntax, transformers' assisted generation with the
export, and every load refusing NaN and truncated checkpoints.

A module fixture exports, offline, a tiny distillspec Llama target and a smaller Llama draft
with a BPE tokenizer.json (`tests.test_your_target`'s), as `python -m distillspec.train` does.
Each defect is planted in a copy of the draft.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import shutil

import gin
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from distillspec import gin_setup, serve_check, serving
from distillspec.models import T5LM, DecoderOnlyLM, T5Config, TransformerConfig, load_checkpoint
from distillspec.models.t5x import from_t5x, save_t5x
from distillspec.models.weight_checks import CheckpointError
from distillspec.runs.common import export
from distillspec.vocabularies import load_tokenizer
from tests.test_your_target import CODE, _bpe_tokenizer

# The engines' documented syntax (docs/serving.md cites the pages): vLLM's
# `vllm serve TARGET --speculative-config '{"method": "draft_model", "model": DRAFT,
# "num_speculative_tokens": k}'`, SGLang's launch_server flags for a STANDALONE draft (a chain:
# top-k 1, k steps, k + 1 tokens to verify), transformers' generate(assistant_model=...).
DOCUMENTED = {
    "vllm": {
        "program": ["vllm", "serve"],
        "flags": {"--speculative-config"},
        "config_keys": {"method", "model", "num_speculative_tokens"},
        "method": "draft_model",
    },
    "sglang": {
        "program": ["python", "-m", "sglang.launch_server"],
        "flags": {
            "--model-path",
            "--speculative-algorithm",
            "--speculative-draft-model-path",
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
        },  # fmt: skip
        "algorithm": "STANDALONE",
    },
    "transformers": {"generate_kwargs": ("assistant_model=draft", "num_assistant_tokens=")},
}


def _llama(vocab: int, width: int, layers: int, seed: int):
    config = TransformerConfig(
        vocab_size=vocab, embed_dim=width, num_layers=layers, num_heads=4, num_kv_heads=2,
        head_dim=width // 4, mlp_dim=2 * width, init_std=0.3,
    )  # fmt: skip
    model = DecoderOnlyLM(config)
    return model, model.init(jax.random.PRNGKey(seed))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """{'target', 'draft', 'tokenizer', 'root'}: exports with the same tokenizer."""
    root = tmp_path_factory.mktemp("serving")
    (root / "tok").mkdir()
    size = _bpe_tokenizer(root / "tok")
    (root / "tok" / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tokenizer = load_tokenizer(None, str(root / "tok"))
    paths = {}
    for name, (width, layers, seed) in {"target": (32, 2, 0), "draft": (16, 1, 1)}.items():
        paths[name] = str(root / name)
        export(*_llama(size, width, layers, seed), tokenizer, paths[name])
    return {**paths, "tokenizer": tokenizer, "root": root, "size": size}


def _copy(pair, name: str) -> pathlib.Path:
    copy = pair["root"] / name
    shutil.copytree(pair["draft"], copy, dirs_exist_ok=True)
    return copy


def _check(draft, pair, *flags) -> tuple[int, str, dict]:
    out = pathlib.Path(draft).parent / f"{pathlib.Path(draft).name}.json"
    code = serve_check.main([str(draft), "--target", pair["target"], "--json", str(out), *flags])
    return code, out.read_text(), json.loads(out.read_text())


def _blocked(report) -> dict[str, list[str]]:
    return {e: r["problems"] for e, r in report["engines"].items() if not r["ready"]}


def test_the_export_is_ready_for_every_engine(pair, capsys):
    code, _, report = _check(pair["draft"], pair)
    assert code == 0 and report["ready"], report
    assert set(report["engines"]) == set(serving.ENGINES)
    printed = capsys.readouterr().out
    assert "vllm: ready" in printed and "--speculative-algorithm STANDALONE" in printed


def _plant_vocab(pair, path):
    tokenizer = pair["tokenizer"]
    shutil.rmtree(path)
    export(*_llama(pair["size"] + 8, 16, 1, 1), tokenizer, str(path))


def _plant_missing_tokenizer(pair, path):
    (path / "tokenizer.json").unlink()


def _plant_truncated(pair, path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _plant_nan(pair, path):
    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_tokens.weight"][3, :] = np.nan  # Rows no prompt might touch.
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _plant_special_ids(pair, path):
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = 0
        (path / name).write_text(json.dumps(config))


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def _plant_tied(pair, path):
    _edit_config(path, tie_word_embeddings=True)  # The file keeps its own, different lm_head.


def _plant_dtype(pair, path):
    _edit_config(path, torch_dtype="bfloat16")  # The tensors are float32.


# (defect, how it is planted, the engines it blocks, words the problem must contain).
ALL = set(serving.ENGINES)
DEFECTS = [
    ("vocab", _plant_vocab, ALL, ["vocabulary", "vocab_size"]),
    ("no_tokenizer", _plant_missing_tokenizer, {"vllm", "sglang"}, ["tokenizer files"]),
    ("truncated", _plant_truncated, ALL, ["files", "truncated", "model.safetensors"]),
    ("nan", _plant_nan, ALL, ["values", "model.embed_tokens.weight", "model.safetensors", "NaN"]),
    ("special_ids", _plant_special_ids, ALL, ["special tokens", "eos_token_id is 0"]),
    ("tied", _plant_tied, ALL, ["tied embeddings", "tie_word_embeddings=true"]),
    ("dtype", _plant_dtype, {"vllm", "sglang"}, ["dtype", "'bfloat16'", "float32"]),
]


@pytest.mark.parametrize("name,plant,engines,words", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_each_planted_defect_is_named_with_the_engines_it_blocks(pair, name, plant, engines, words):
    path = _copy(pair, name)
    plant(pair, path)
    code, _, report = _check(path, pair)
    assert code == 1 and not report["ready"]
    blocked = _blocked(report)
    assert set(blocked) == engines, blocked
    for engine in engines:
        text = " | ".join(blocked[engine])
        assert all(w in text for w in words), (engine, text)


def test_a_t5_draft_is_not_ready_for_vllm(pair, tmp_path, capsys):
    config = T5Config(
        vocab_size=pair["size"], embed_dim=16, num_encoder_layers=1, num_decoder_layers=1,
        num_heads=2, head_dim=8, mlp_dim=32,
    )  # fmt: skip
    model = T5LM(config)
    export(model, model.init(jax.random.PRNGKey(0)), pair["tokenizer"], str(tmp_path / "t5"))
    code, _, report = _check(tmp_path / "t5", pair, "--engine", "vllm")
    assert code == 1 and list(report["engines"]) == ["vllm"]
    problems = report["engines"]["vllm"]["problems"]
    assert any(p.startswith("architecture: T5ForConditionalGeneration") for p in problems)
    assert any("vLLM" in p and "LlamaForCausalLM" in p for p in problems)
    assert "vllm: not ready" in capsys.readouterr().out


def test_serve_commands_match_the_documented_syntax(pair):
    cmds = serving.commands(pair["draft"], pair["target"], gamma=4)
    vllm = shlex.split(cmds["vllm"])
    assert vllm[:2] == DOCUMENTED["vllm"]["program"] and vllm[2] == pair["target"]
    flags = {a for a in vllm if a.startswith("--")}
    assert flags == DOCUMENTED["vllm"]["flags"]
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert set(spec) == DOCUMENTED["vllm"]["config_keys"]
    assert spec == {"method": "draft_model", "model": pair["draft"], "num_speculative_tokens": 4}
    sglang = shlex.split(cmds["sglang"])
    assert sglang[:3] == DOCUMENTED["sglang"]["program"]
    values = dict(zip(sglang[3::2], sglang[4::2], strict=True))
    assert set(values) == DOCUMENTED["sglang"]["flags"]
    assert values == {
        "--model-path": pair["target"], "--speculative-algorithm": "STANDALONE",
        "--speculative-draft-model-path": pair["draft"], "--speculative-num-steps": "4",
        "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "5",
    }  # fmt: skip
    assert all(kw in cmds["transformers"] for kw in DOCUMENTED["transformers"]["generate_kwargs"])


def test_gamma_comes_from_the_evaluation_then_the_plan_then_the_recipe(tmp_path):
    records = [
        {"draft": "d", "gamma": 3, "latency_speedup": 1.2, "temperature": 0.0},
        {"draft": "d", "gamma": 5, "latency_speedup": 1.5, "temperature": 0.0},
        {"draft": "d", "gamma": 7, "latency_speedup": 1.4, "temperature": 0.0},
        {"draft": "d", "policy": "oracle", "latency_speedup": 9.0},
        {"draft": "e", "gamma": 7, "latency_speedup": 3.0, "temperature": 0.0},
    ]
    assert serving.best_gamma(records, "d") == 5
    assert serving.best_gamma(records, "x") is None
    assert serving.serving_gamma(5, 2, 3)[0] == 5
    assert serving.serving_gamma(None, 2, 3) == (2, "the plan's (python -m distillspec.plan)")
    assert serving.serving_gamma(None, None, 3)[0] == 3
    report = {"draft": str(tmp_path), "target": "t", "engines": {}, "notes": []}
    serving.write_serving(report, 6, "the plan's", str(tmp_path))
    assert serving.serving_gamma(None, None, 3, str(tmp_path)) == (6, "the plan's")


def test_assisted_generation_with_the_export_equals_plain_greedy(pair):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(pair["target"])
    target = transformers.AutoModelForCausalLM.from_pretrained(pair["target"])
    draft = transformers.AutoModelForCausalLM.from_pretrained(pair["draft"])
    for prompt in [c[:14] for c in CODE[:8]]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        plain = target.generate(ids, max_new_tokens=12, do_sample=False)
        assisted = target.generate(
            ids, assistant_model=draft, num_assistant_tokens=3,
            num_assistant_tokens_schedule="constant", max_new_tokens=12, do_sample=False,
        )  # fmt: skip
        assert torch.equal(plain, assisted), prompt
    # The printed snippet runs as printed.
    scope: dict = {}
    exec(serving.commands(pair["draft"], pair["target"], gamma=3)["transformers"], scope)
    assert scope["output"].shape[1] > scope["inputs"]["input_ids"].shape[1]


# Every load checks its weights. ----------------------------------------------------------------


def test_nan_and_truncated_checkpoints_fail_to_load(pair):
    nan, cut = _copy(pair, "load_nan"), _copy(pair, "load_cut")
    _plant_nan(pair, nan)
    _plant_truncated(pair, cut)
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight' in .*load_nan"):
        load_checkpoint(str(nan))
    with pytest.raises(
        CheckpointError, match=r"load_cut/model\.safetensors is truncated: it holds"
    ):
        load_checkpoint(str(cut))


def test_a_nan_t5x_checkpoint_fails_to_load(tmp_path):
    config = T5Config(
        vocab_size=32, embed_dim=16, num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
        head_dim=8, mlp_dim=32,
    )  # fmt: skip
    model = T5LM(config)
    params = jax.tree.map(np.array, model.init(jax.random.PRNGKey(0)))
    params["embed"]["embedding"][5, 2] = np.inf
    save_t5x(model, params, str(tmp_path))
    with pytest.raises(CheckpointError, match=r"target/token_embedder/embedding.*1 non-finite"):
        from_t5x(str(tmp_path))


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_evaluate_and_train_refuse_a_nan_or_truncated_checkpoint(pair, tmp_path, capsys, clean_gin):
    nan, cut = _copy(pair, "run_nan"), _copy(pair, "run_cut")
    _plant_nan(pair, nan)
    _plant_truncated(pair, cut)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": c[:12], "completion": c[12:]}) + "\n" for c in CODE)
    )
    evaluate = lambda draft: gin_setup.main("evaluate", [
        "--gin_file=runs/evaluate.gin", f"--gin.OUTPUT_DIR={tmp_path / 'eval'}",
        f"--gin.TARGET_CHECKPOINT={pair['target']}", f"--gin.DRAFTS={{'d': {str(draft)!r}}}",
        f"--gin.EVAL_SETS=[({str(data)!r}, 'train')]", "--gin.GAMMAS=[2]",
    ])  # fmt: skip
    train = lambda teacher: gin_setup.main("train", [
        "--gin_file=runs/distill.gin", "--gin.TRAIN_STEPS=1", "--gin.STUDENT_CHECKPOINT=None",
        f"--gin.MODEL_DIR={tmp_path / 'train'}", f"--gin.TEACHER_CHECKPOINT={str(teacher)!r}",
        f"--gin.MIXTURE_OR_TASK_NAME={str(data)!r}", "--gin.train.student=@DraftSpec()",
    ])  # fmt: skip
    for run, path, words in [
        (evaluate, nan, ["model.embed_tokens.weight", "run_nan/model.safetensors", "NaN"]),
        (evaluate, cut, ["run_cut/model.safetensors is truncated"]),
        (train, nan, ["model.embed_tokens.weight", "run_nan/model.safetensors"]),
        (train, cut, ["run_cut/model.safetensors is truncated"]),
    ]:
        gin.clear_config()
        with pytest.raises(SystemExit) as stopped:
            run(path)
        err = capsys.readouterr().err
        assert stopped.value.code == 1 and err.startswith("error: ")
        assert all(w in err for w in words) and "Traceback" not in err, err


@pytest.fixture(scope="module")
def hf_llama(pair):
    """A target made by transformers (not exported by distillspec), with the pair's tokenizer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=pair["size"], hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    path = pair["root"] / "hf_llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(pair["root"] / "tok" / name, path / name)
    return str(path)


def test_train_and_evaluate_print_the_serve_commands(hf_llama, tmp_path, capsys, clean_gin):
    """experiments/your_target.gin on a transformers Llama: the export checks ready for every
    engine, and the commands carry the plan's γ, then the evaluation's."""
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": c[:12], "completion": c[12:]}) + "\n" for c in CODE)
    )
    gin_setup.main("train", [
        "--gin_file=experiments/your_target.gin", "--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=2",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 6}",
        f"--gin.MODEL_DIR={tmp_path / 'run'}", f"--gin.TEACHER_CHECKPOINT={hf_llama!r}",
        f"--gin.MIXTURE_OR_TASK_NAME={str(data)!r}", "--gin.DraftSpec.num_layers=1",
        "--gin.train.serve_gamma=3",
    ])  # fmt: skip
    export_dir = tmp_path / "run" / "export"
    printed = capsys.readouterr().out
    assert "γ = 3: the plan's" in printed
    for engine in serving.ENGINES:
        assert f"{engine}: ready" in printed
    written = (export_dir / serving.SERVING_FILE).read_text()
    assert '"num_speculative_tokens": 3' in written and "--speculative-num-steps 3" in written
    gin.clear_config()
    records = gin_setup.main("evaluate", [
        "--gin_file=runs/evaluate.gin", f"--gin.OUTPUT_DIR={tmp_path / 'eval'}",
        f"--gin.TARGET_CHECKPOINT={hf_llama}", f"--gin.DRAFTS={{'d': {str(export_dir)!r}}}",
        f"--gin.EVAL_SETS=[({str(data)!r}, 'train')]", "--gin.GAMMAS=[2]",
        "--gin.TEMPERATURES=[0.0]", "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 6}",
        "--gin.NUM_PROMPTS=2", "--gin.evaluate.batch_size=2", "--gin.evaluate.quality=False",
    ])  # fmt: skip
    best = serving.best_gamma(records, "d")
    printed = capsys.readouterr().out
    assert best == 2 and f"γ = {best}: the evaluation's best" in printed
    assert f'"num_speculative_tokens": {best}' in (export_dir / serving.SERVING_FILE).read_text()
    assert "vLLM (draft_model): ready" in (tmp_path / "eval" / serving.SERVING_FILE).read_text()
