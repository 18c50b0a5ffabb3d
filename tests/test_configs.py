"""Every gin file under configs/ parses, finalizes and builds valid config objects.

Files are globbed, so a new gin file is tested as soon as it exists. A file's `%gin.REQUIRED`
macros (MODEL_DIR, TEACHER_CHECKPOINT, ...) are discovered by parsing it once, then bound to
dummy values; nothing is trained.
"""

from __future__ import annotations

import pathlib
import re

import gin
import pytest

from distillspec import datagen, gin_setup, trainer
from distillspec.decoding.sampling import SamplingConfig
from distillspec.models import T5Config, TransformerConfig

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
GIN_FILES = sorted(CONFIGS.rglob("*.gin"))
# Typed configs built under every scope a file binds, so that bad values fail here.
CONFIG_CLASSES = (
    trainer.LossConfig,
    trainer.OptimizerConfig,
    trainer.LoopConfig,
    datagen.DataMixture,
    SamplingConfig,
    TransformerConfig,
    T5Config,
)


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_the_known_configs_are_found():
    names = {str(p.relative_to(CONFIGS)) for p in GIN_FILES}
    assert {
        "runs/pretrain.gin",
        "runs/distill.gin",
        "tests/tiny_distill.gin",
        "experiments/supervised_kd.gin",
        "experiments/seqkd.gin",
        "experiments/imitkd.gin",
        "experiments/fdistill.gin",
        "experiments/gkd.gin",
    } <= names


def _scopes(config: str) -> set[str]:
    """'' plus every scope used in a binding line ('target/LoopConfig.x = 1' -> 'target')."""
    return {""} | set(re.findall(r"^([\w.]+(?:/[\w.]+)*)/[\w.]+ = ", config, re.MULTILINE))


@pytest.mark.parametrize("path", GIN_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_gin_file_parses_with_its_required_macros_bound(path):
    gin_setup.load_config([str(path)], [])
    required = gin_setup.unbound_required()
    # Run files document their REQUIRED macros in the header comment.
    header = "".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    if path.parent.name == "runs":
        for name in required:
            assert name in header, f"{path.name}: REQUIRED {name} is not in the header"
    gin.clear_config()
    dummies = [f"{name} = 'dummy_{name.lower()}'" for name in required]
    gin_setup.load_config([str(path)], dummies)
    assert gin_setup.unbound_required() == []
    config = gin.config_str()
    for name in required:
        assert f"{name} = 'dummy_{name.lower()}'" in config
    gin.finalize()
    for scope in sorted(_scopes(config)):
        with gin.config_scope(scope or None):
            for cls in CONFIG_CLASSES:
                gin.get_configurable(cls.__name__)()  # Validates in __post_init__.


def test_required_macros_are_reported_by_name():
    gin_setup.load_config([str(CONFIGS / "runs" / "distill.gin")], ["MODEL_DIR = '/tmp/x'"])
    # The draft is optional: STUDENT_CHECKPOINT or STUDENT (see the file's header).
    assert gin_setup.unbound_required() == ["TEACHER_CHECKPOINT"]


def test_includes_resolve_with_a_runs_directory_in_the_working_directory(tmp_path, monkeypatch):
    # After the quickstart, ./runs/ exists; gin must still find configs/runs/*.gin.
    from distillspec import gin_setup

    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    gin_setup.clear()
    try:
        gin_setup.load_config(["experiments/disco_quickstart.gin"], [])
        gin_setup.clear()
        gin_setup.load_config(["experiments/gkd.gin"], ["MODEL_DIR = '/tmp/x'"])
    finally:
        gin_setup.clear()
