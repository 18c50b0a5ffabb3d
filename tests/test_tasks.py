"""Tests for the data layer: stdlib / HumanEval corpora, vocabularies, seqio tasks, batches.

Hermetic: no network. TFDS tasks run on `tfds.testing.mock_data`; the missing-data error is
checked against an empty temporary directory.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
import time

import numpy as np
import pytest
import sentencepiece as spm
import seqio
import tensorflow_datasets as tfds

from distillspec import corpus, tasks, vocabularies
from distillspec.feature_converters import prompt_batches

TFDS_TASK_NAMES = tuple(tasks.TFDS_TASKS)
CODE_SAMPLES = (
    "def f(x):\n\treturn x  # tab-indented\n",
    "class A:\n    def g(self):\n        '''Doc — ünïcödé, 中文, emoji 😀.'''\n        return 1\n",
    "x = [1,\n     2]   \n\n\n    trailing spaces   \n",
    "if a:\r\n    b = '\\n'\r\n",  # Windows newlines and an escaped newline.
    "   leading spaces and\t\tmixed \t whitespace\n\n",
    "",
    "\n",
    "λ = lambda s: s[::-1]  # Greek, \x0c form feed\n",
)


@pytest.fixture(scope="module")
def code_corpus() -> dict[str, list[corpus.CodeExample]]:
    return corpus.build_code_corpus()


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory) -> pathlib.Path:
    texts = corpus.code_training_text(corpus.build_code_corpus())
    start = time.perf_counter()
    path = vocabularies.train_sentencepiece(texts, cache_dir=tmp_path_factory.mktemp("spm"))
    print(f"SentencePiece training took {time.perf_counter() - start:.2f} s")
    return path


@pytest.fixture(scope="module")
def vocab(spm_path) -> seqio.SentencePieceVocabulary:
    return seqio.SentencePieceVocabulary(str(spm_path))


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("empty_tfds")


@pytest.fixture(scope="module")
def registered(vocab, tfds_dir) -> list[str]:
    return tasks.register_tasks(vocab, tfds_data_dir=str(tfds_dir))


# ------------------------------------------------------------------------------- stdlib corpus


def test_full_corpus_counts_disjoint_and_deterministic(code_corpus):
    counts = {s: len(v) for s, v in code_corpus.items()}
    print("stdlib_code examples per split:", counts)
    assert counts["train"] > 4000 and counts["validation"] > 150 and counts["test"] > 150
    total = sum(counts.values())
    assert 0.85 < counts["train"] / total < 0.95
    keys = {s: {(e.path, e.qualname) for e in v} for s, v in code_corpus.items()}
    assert not keys["train"] & keys["validation"]
    assert not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
    ids = [e.id for v in code_corpus.values() for e in v]
    assert len(ids) == len(set(ids))
    corpus._extract_all.cache_clear()  # Rebuild from disk, not from the in-process cache.
    assert corpus.build_code_corpus() == code_corpus


def test_examples_are_dedented_slices_of_the_source(code_corpus):
    root = corpus.stdlib_root()
    examples = [e for v in code_corpus.values() for e in v]
    for ex in examples[::25]:
        lines = corpus.split_lines(corpus.read_source(root / ex.path))
        text = "".join(lines[ex.start_line - 1 : ex.end_line])
        assert textwrap.dedent(text) == ex.prompt + ex.completion, ex.id
        assert ex.prompt.endswith("\n") and ex.completion.strip()
        tree = ast.parse(ex.prompt + ex.completion)  # A complete function on its own.
        (node,) = tree.body
        assert ast.get_docstring(node) is not None and node.name == ex.qualname.split(".")[-1]
        assert len(ex.completion) <= corpus.DEFAULT_MAX_COMPLETION_CHARS
        # Top-level functions need no dedent: the text is then literally in the file.
        span = lines[ex.start_line - 1 : ex.end_line]
        if not text[0].isspace() and all(line.strip() or line == "\n" for line in span):
            assert ex.prompt + ex.completion in "".join(lines)


def test_library_file_filter():
    files = corpus.list_stdlib_files()
    assert "json/decoder.py" in files and "os.py" in files
    for path in files:
        parts = path.split("/")
        assert not {"test", "tests", "idlelib", "site-packages", "idle_test"} & set(parts), path
        assert not path.startswith("_sysconfigdata_")
    assert corpus.list_stdlib_files(max_files=3) == files[:3]


def test_split_for_key_is_stable_and_90_5_5():
    # Golden values: SHA-256 based, so identical on every machine and every run.
    assert [corpus.split_for_key(f"k{i}") for i in range(6)] == [
        corpus.split_for_key(f"k{i}") for i in range(6)
    ]
    splits = [corpus.split_for_key(f"file.py::f{i}") for i in range(20_000)]
    frac = {s: splits.count(s) / len(splits) for s in corpus.SPLITS}
    assert frac["train"] == pytest.approx(0.90, abs=0.01)
    assert frac["validation"] == pytest.approx(0.05, abs=0.01)
    assert frac["test"] == pytest.approx(0.05, abs=0.01)


SOURCE = '''\
import functools


@functools.cache
def decorated(a,
              b):
    """Two-line
    docstring."""
    # comment

    return a + b


def only_doc():
    """Nothing else."""


def trivial():
    """Pass only."""
    pass


def same_line():
    """Doc."""; return 1


class K:
    def method(self):
        """Method doc."""
        def inner():
            """Nested: part of method's body, not an example."""
            return 2
        return inner()

if True:
    def conditional(x):
        """Defined under an if."""
        return x
'''


def test_extract_functions_edge_cases():
    got = {e.qualname: e for e in corpus.extract_functions(SOURCE, "m.py")}
    assert sorted(got) == ["K.method", "conditional", "decorated"]
    dec = got["decorated"]
    assert dec.prompt == (
        "@functools.cache\ndef decorated(a,\n              b):\n"
        '    """Two-line\n    docstring."""\n'
    )
    assert dec.completion == "    # comment\n\n    return a + b\n"
    assert got["K.method"].prompt.startswith("def method(self):\n")
    assert got["conditional"].id == "m.py::conditional:36"


def test_unparsable_source_is_skipped():
    assert corpus.extract_functions("print 'python 2'\ndef f(:\n", "bad.py") == []


def test_lm_corpus_is_deterministic_and_excludes_held_out_bodies(code_corpus):
    lm = corpus.build_lm_corpus()
    assert set(lm) == {"train", "validation"} and len(lm["train"]) > 1000
    assert all(0 < len(c) <= 4 * corpus.DEFAULT_LM_CHUNK_CHARS for c in lm["train"][:500])
    text = "".join(lm["train"]) + "".join(lm["validation"])
    checked = 0
    for ex in [e for e in code_corpus["test"] if len(e.completion) > 300][:40]:
        source = corpus.read_source(corpus.stdlib_root() / ex.path)
        lines = corpus.split_lines(source)
        first_body_line = ex.start_line - 1 + len(corpus.split_lines(ex.prompt))
        body = "".join(lines[first_body_line : first_body_line + 4])  # Raw, as in the file.
        if source.count(body) == 1:  # Unique in its file, so any match would be a leak.
            assert body not in text, ex.id
            checked += 1
    assert checked >= 20
    corpus._extract_all.cache_clear()
    assert corpus.build_lm_corpus() == lm


# ------------------------------------------------------------------------------------ HumanEval


def test_humaneval_has_164_problems():
    problems = corpus.load_humaneval()
    assert len(problems) == 164
    assert [p["id"] for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    for p in problems:
        assert f"def {p['entry_point']}" in p["prompt"]
        ast.parse(p["prompt"] + p["completion"])  # Parsed only, never executed.


# --------------------------------------------------------------------------------- vocabularies


def test_sentencepiece_round_trip_is_exact(spm_path, vocab, code_corpus):
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    samples = list(CODE_SAMPLES) + [e.prompt + e.completion for e in code_corpus["test"][:50]]
    for text in samples:
        assert sp.decode(sp.encode(text)) == text, repr(text)
        assert vocab.decode(vocab.encode(text)) == text, repr(text)
        tf_ids = vocab.encode_tf(text)
        assert vocab.decode_tf(tf_ids).numpy().decode("utf-8") == text, repr(text)
    assert vocab.vocab_size == vocabularies.DEFAULT_VOCAB_SIZE
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2)
    # Compression sanity: code should need well under one token per character.
    text = "".join(samples[len(CODE_SAMPLES) :])
    assert len(sp.encode(text)) < 0.5 * len(text)


def test_sentencepiece_training_is_deterministic_and_cached(spm_path, tmp_path):
    texts = corpus.code_training_text(corpus.build_code_corpus())
    again = vocabularies.train_sentencepiece(texts, cache_dir=tmp_path)
    assert again.name == spm_path.name
    assert again.read_bytes() == spm_path.read_bytes()
    mtime = again.stat().st_mtime_ns
    assert vocabularies.train_sentencepiece(texts, cache_dir=tmp_path) == again
    assert again.stat().st_mtime_ns == mtime  # Served from the cache, not retrained.


def test_byte_vocabulary_and_names(monkeypatch, tmp_path):
    byte = vocabularies.get_vocabulary("byte")
    assert isinstance(byte, seqio.ByteVocabulary)
    for text in CODE_SAMPLES:
        assert byte.decode(byte.encode(text)) == text
    with pytest.raises(ValueError, match="'nope'.*sentencepiece"):
        vocabularies.get_vocabulary("nope")
    monkeypatch.setenv(vocabularies.CACHE_ENV_VAR, str(tmp_path))
    assert vocabularies.default_cache_dir() == tmp_path


def test_get_vocabulary_small_corpus(tmp_path):
    vocab = vocabularies.get_vocabulary(cache_dir=tmp_path, max_files=60, vocab_size=512)
    assert vocab.vocab_size == 512 and len(list(tmp_path.glob("*.model"))) == 1
    assert vocab.decode(vocab.encode(CODE_SAMPLES[1])) == CODE_SAMPLES[1]


# -------------------------------------------------------------------------------- seqio tasks


def test_register_tasks_is_idempotent(registered, vocab, tfds_dir):
    assert registered == [
        "stdlib_code", "stdlib_lm", "humaneval", "pydoc_prose", *TFDS_TASK_NAMES
    ]  # fmt: skip
    assert tasks.register_tasks(vocab, tfds_data_dir=str(tfds_dir)) == registered
    assert set(registered) <= set(seqio.TaskRegistry.names())


@pytest.mark.parametrize(
    "name,split",
    [
        ("stdlib_code", "validation"),
        ("humaneval", "test"),
        ("stdlib_lm", "train"),
        ("pydoc_prose", "test"),
    ],  # fmt: skip
)
def test_tasks_yield_tokenized_features(registered, vocab, name, split):
    task = seqio.get_mixture_or_task(name)
    ds = task.get_dataset(sequence_length=None, split=split, shuffle=False)
    ex = next(ds.as_numpy_iterator())
    assert ex["targets"].dtype == np.int32 and ex["targets"][-1] == vocab.eos_id
    assert vocab.decode(ex["targets"].tolist()) == ex["targets_pretokenized"].decode()
    if name != "stdlib_lm":
        assert ex["inputs"][-1] != vocab.eos_id  # The prompt is continued, not closed.
        assert vocab.decode(ex["inputs"].tolist()) == ex["inputs_pretokenized"].decode()
    else:
        assert "inputs" not in ex


def test_task_splits(registered):
    splits = {n: tuple(seqio.get_mixture_or_task(n).splits) for n in registered}
    assert splits["stdlib_code"] == ("train", "validation", "test")
    assert splits["humaneval"] == ("test",)
    humaneval = seqio.get_mixture_or_task("humaneval").get_dataset(None, split="test")
    assert sum(1 for _ in humaneval) == 164
    assert splits["pydoc_prose"] == ("train", "test")


def test_prose_corpus_holds_out_whole_topics_and_loses_no_text():
    """The drift stream of python -m distillspec.online: over 1,000 training passages, and
    test passages found in no training topic; each pair is one passage of a topic."""
    from pydoc_data import topics

    built = corpus.build_prose_corpus()
    assert len(built["train"]) > 1000 and len(built["test"]) >= 128
    train = {
        n: t for n, t in topics.topics.items() if corpus.split_for_key("prose::" + n) == "train"
    }
    for split, pairs in built.items():
        for prompt, completion in pairs:
            assert any(prompt + completion in text for text in topics.topics.values())
            in_train = any(prompt + completion in text for text in train.values())
            assert in_train == (split == "train"), (split, prompt[:40])


# ------------------------------------------------------------------------------- prompt batches


def test_prompt_batches_shapes_and_full_coverage(registered):
    batches = list(prompt_batches("humaneval", "test", 16, 64, 32, shuffle=False))
    assert len(batches) == 11  # 164 = 10 * 16 + 4, the last batch padded.
    for b in batches:
        assert b["prompt_tokens"].shape == (16, 64) and b["prompt_tokens"].dtype == np.int32
        assert b["completion_tokens"].shape == (16, 32) and b["prompt_lengths"].shape == (16,)
        assert b["prompt_lengths"].dtype == np.int32
        cols = np.arange(64)[None, :] >= b["prompt_lengths"][:, None]
        assert (b["prompt_tokens"][cols] == 0).all()  # Right padding.
    assert sum(int(b["valid"].sum()) for b in batches) == 164
    assert not batches[-1]["valid"][4:].any() and batches[-1]["valid"][:4].all()
    dropped = list(prompt_batches("humaneval", "test", 16, 64, 32, drop_remainder=True))
    assert len(dropped) == 10


def test_prompts_are_truncated_from_the_left(registered):
    task = seqio.get_mixture_or_task("humaneval")
    first = next(task.get_dataset(None, split="test", shuffle=False).as_numpy_iterator())
    b = next(prompt_batches("humaneval", "test", 2, 20, 8, shuffle=False))
    assert b["prompt_lengths"][0] == 20
    np.testing.assert_array_equal(b["prompt_tokens"][0], first["inputs"][-20:])
    np.testing.assert_array_equal(b["completion_tokens"][0], first["targets"][:8])


def test_prompt_batches_are_deterministic_given_seed(registered):
    def take(seed):
        it = prompt_batches("stdlib_code", "validation", 8, 32, 16, seed=seed)
        return [next(it)["prompt_tokens"] for _ in range(3)]

    a, b, c = take(0), take(0), take(1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any((x != z).any() for x, z in zip(a, c, strict=True))


def test_prompt_batches_lm_task_and_epochs(registered):
    it = prompt_batches("stdlib_lm", "validation", 4, 16, 8, num_epochs=None)
    b = next(it)
    assert (b["prompt_lengths"] == 8).all() and b["valid"].all()
    humaneval = list(prompt_batches("humaneval", "test", 41, 8, 8, num_epochs=2))
    assert len(humaneval) == 8 and all(b["valid"].all() for b in humaneval)


def test_empty_and_unknown_splits_raise(vocab):
    tasks.register_text_task(
        "empty_for_test",
        lambda: {
            "train": {"inputs": ["a"], "targets": ["b"]},
            "test": {"inputs": [], "targets": []},
        },
        ("train", "test"),
        vocab,
    )
    with pytest.raises(ValueError, match="'empty_for_test'.*'test'.*no examples"):
        next(prompt_batches("empty_for_test", "test", 2, 4, 4))
    with pytest.raises(ValueError, match="'empty_for_test'.*'validation'"):
        next(prompt_batches("empty_for_test", "validation", 2, 4, 4))
    assert next(prompt_batches("empty_for_test", "train", 2, 4, 4))["valid"].sum() == 1


# ---------------------------------------------------------------------------------- TFDS tasks


@pytest.mark.parametrize("name", TFDS_TASK_NAMES)
def test_tfds_tasks_with_mock_data(registered, vocab, name):
    spec = tasks.TFDS_TASKS[name]
    task = seqio.get_mixture_or_task(name)
    assert tuple(task.splits) == spec.splits
    with tfds.testing.mock_data(num_examples=5):
        ds = task.get_dataset(sequence_length=None, split=spec.splits[-1], shuffle=False)
        examples = list(ds.as_numpy_iterator())
        batch = next(prompt_batches(name, spec.splits[-1], 4, 32, 16, seed=3))
    assert len(examples) == 5
    ex = examples[0]
    assert ex["targets"][-1] == vocab.eos_id
    if spec.inputs_key is None:
        assert "inputs" not in ex
    else:
        assert ex["inputs_pretokenized"].decode().startswith(spec.prefix)
        assert vocab.decode(ex["inputs"].tolist()) == ex["inputs_pretokenized"].decode()
    assert batch["prompt_tokens"].shape == (4, 32) and batch["valid"].all()


def test_wmt_translates_english_to_german(registered):
    with tfds.testing.mock_data(num_examples=1):
        builder_ex = next(iter(tfds.load("wmt14_translate/de-en", split="test")))
        task = seqio.get_mixture_or_task("wmt14_en_de")
        ex = next(task.get_dataset(None, split="test", shuffle=False).as_numpy_iterator())
    assert ex["inputs_pretokenized"] == b"translate English to German: " + builder_ex["en"].numpy()
    assert ex["targets_pretokenized"] == builder_ex["de"].numpy()


@pytest.mark.parametrize("name", TFDS_TASK_NAMES)
def test_missing_tfds_data_raises_clear_error(registered, tfds_dir, name):
    tfds_name = tasks.TFDS_TASKS[name].tfds_name
    task = seqio.get_mixture_or_task(name)
    with pytest.raises(tasks.DatasetMissingError) as info:
        task.get_dataset(sequence_length=None, split="test", shuffle=False)
    message = str(info.value)
    for needle in (
        tfds_name,
        str(tfds_dir),
        "tfds build",
        "download_and_prepare",
        "--tfds_data_dir",
    ):
        assert needle in message
    with pytest.raises(tasks.DatasetMissingError):
        next(prompt_batches(name, "test", 2, 4, 4))
    assert not any(tfds_dir.iterdir())  # Nothing was downloaded or generated.


def test_any_tfds_data_set_by_spec(vocab):
    """A TFDS data set beyond the built-in ones, from a TfdsTaskSpec (gin: @TfdsTaskSpec())."""
    spec = tasks.TfdsTaskSpec("ag_news_subset:1.0.0", ("train", "test"), "description", "title")
    name = tasks.register_task(spec, vocab)
    assert name == "tfds_ag_news_subset_1_0_0" and tasks.as_task(spec) is spec
    with tfds.testing.mock_data(num_examples=3):
        batch = next(prompt_batches(name, "test", 4, 16, 4, shuffle=False))
    assert batch["valid"].sum() == 3 and (batch["prompt_lengths"][:3] > 0).all()
