"""Gin glue for the run functions: what is configurable, and T5X's command-line flags.

This is the only module that imports gin. The run functions of `distillspec.runs` and the typed
config objects are registered here as external configurables under the names configs use
(`distillspec.train.train`, `distillspec.evaluate.evaluate`, `distillspec.quickstart.quickstart`,
`distillspec.disco.disco`), so a gin file can say `train.model_dir = %MODEL_DIR` or
`LossConfig.divergence = 'jsd'`, and the modules that define them stay plain Python.
The `python -m distillspec.<run>` entry points call `main(run name)`; for training, `main` also
starts a multi-process run (`--multiprocess`, `distillspec.distributed`) before anything
touches the JAX backend.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

import gin

from distillspec import command_line, datagen, distributed, tasks, trainer
from distillspec.decoding.sampling import SamplingConfig
from distillspec.models import T5LM, DecoderOnlyLM, T5Config, TransformerConfig
from distillspec.models.drafts import DraftSpec
from distillspec.models.weight_checks import CheckpointError
from distillspec.runs import disco, evaluate, online, plan, quickstart, train
from distillspec.study import pipeline, recipes

CONFIGS_DIR = command_line.CONFIGS_DIR


@functools.cache
def register_configurables() -> dict[str, Callable[..., Any]]:
    """Makes run functions, config classes and models bindable (once per process).

    Returns:
      {run name: the gin-configured run function}.
    """
    runs = {
        "train": gin.external_configurable(
            train.train, module="distillspec.train", denylist=["console", "config_text"]
        ),
        "evaluate": gin.external_configurable(evaluate.evaluate, module="distillspec.evaluate"),
        "quickstart": gin.external_configurable(
            quickstart.quickstart, module="distillspec.quickstart", denylist=["stage", "bindings"]
        ),
        "disco": gin.external_configurable(disco.disco, module="distillspec.disco"),
        "study": gin.external_configurable(
            pipeline.study, module="distillspec.study", denylist=["stage", "bindings"]
        ),
        "plan": gin.external_configurable(
            plan.plan, module="distillspec.plan", denylist=["stage", "bindings"]
        ),
        "recipes": gin.external_configurable(
            recipes.recipes, module="distillspec.study", denylist=["stage", "bindings"]
        ),
        "online": gin.external_configurable(online.online, module="distillspec.online"),
    }
    for cls in (TransformerConfig, DecoderOnlyLM, T5Config, T5LM):
        gin.external_configurable(cls, module="distillspec.models")
    for cls in (
        trainer.LoopConfig,
        trainer.LossConfig,
        trainer.OptimizerConfig,
        trainer.EvalConfig,
    ):
        gin.external_configurable(cls, module="distillspec.trainer")
    gin.external_configurable(datagen.DataMixture, module="distillspec.datagen")
    gin.external_configurable(DraftSpec, module="distillspec.models")
    for cls in (tasks.FileTask, tasks.TfdsTaskSpec):
        gin.external_configurable(cls, module="distillspec.tasks")
    gin.external_configurable(SamplingConfig, module="distillspec.decoding")
    return runs


def run_function(name: str, command_line: bool = False) -> Callable[..., Any]:
    """The gin-configured run function `name` ('train', 'evaluate', 'quickstart', 'disco',
    'study', 'plan', 'online'), given what only the gin layer knows: the parsed configuration (for
    MODEL_DIR/config.gin) and, for the quickstart, the study and the plan, their stages as
    gin-configured run functions under scopes. command_line: the run is `python -m
    distillspec.<name>` itself (not a stage of another run): train and evaluate then print the
    serve commands of what they exported or evaluated."""
    configured = register_configurables()[name]
    serve = {"serve_report": True} if command_line and name in ("train", "evaluate") else {}
    if name == "train":
        return lambda **kwargs: configured(config_text=config_str(), **serve, **kwargs)
    if serve:
        return lambda **kwargs: configured(**serve, **kwargs)
    if name in ("quickstart", "study", "plan", "recipes"):
        return lambda **kwargs: configured(stage=scoped_run, bindings=scoped_bindings, **kwargs)
    return configured


def scoped_run(scope_name: str, name: str) -> Callable[..., Any]:
    """The run function `name`, called with the bindings of gin scope `scope_name/` in force."""

    def run(**kwargs):
        with gin.config_scope(scope_name):
            return run_function(name)(**kwargs)

    return run


def scoped_bindings(scope_name: str, name: str) -> dict[str, Any]:
    """The arguments gin would pass to run function `name` under scope `scope_name/`, resolved
    (config objects and models built), e.g. to key a cache of the run's result."""
    with gin.config_scope(scope_name):
        return gin.get_bindings(register_configurables()[name])


MULTIPROCESS_RUNS = ("train",)  # The runs that use a device mesh; the others run on one device.


def main(name: str, argv: list[str] | None = None, parents=()) -> Any:
    """`python -m distillspec.<name>`: parses the flags (`parse_command_line`), runs `name`.

    With --multiprocess, joins the other processes first (`distributed.initialize`). A run
    stopped by a preemption request (SIGTERM) has saved a checkpoint: it says so and exits
    with status `trainer.PREEMPTED_EXIT_CODE` (75); the same command resumes it.
    """
    args = parse_command_line(list(argv if argv is not None else sys.argv[1:]), name, parents)
    if args.multiprocess:
        return _main_multiprocess(name, args)
    try:
        return run_function(name, command_line=True)()
    except trainer.Preempted as e:
        print(e, file=sys.stderr)
        sys.exit(trainer.PREEMPTED_EXIT_CODE)
    except CheckpointError as e:
        _refuse_checkpoint(e)


def _refuse_checkpoint(error: CheckpointError) -> None:
    """A checkpoint refused at load (truncated, corrupt, NaN): its one-line reason, exit 1,
    no traceback (gin appends the configurable's name on a second line: dropped)."""
    print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
    sys.exit(1)


def check_multiprocess_run(name: str) -> None:
    """Raises ValueError if run `name` cannot take --multiprocess (it runs on one device)."""
    if name not in MULTIPROCESS_RUNS:
        raise ValueError(
            f"python -m distillspec.{name} runs in one process on one device; --multiprocess "
            f"applies to {', '.join(f'python -m distillspec.{r}' for r in MULTIPROCESS_RUNS)}"
        )


def _main_multiprocess(name: str, args: argparse.Namespace) -> Any:
    check_multiprocess_run(name)
    config = distributed.DistributedConfig(
        coordinator_address=args.coordinator_address,
        process_count=args.process_count,
        process_index=args.process_index,
        initialization_timeout=args.initialization_timeout,
    )
    mesh_shape = _bound("train.mesh_shape", (1, 1))  # A macro or reference: checked later.
    mesh_shape = mesh_shape if isinstance(mesh_shape, (tuple, list)) else None
    distributed.initialize(config, mesh_shape=mesh_shape)
    try:
        return run_function(name, command_line=True)()
    except trainer.Preempted as e:
        print(e, file=sys.stderr)
        sys.exit(trainer.PREEMPTED_EXIT_CODE)
    except CheckpointError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        os._exit(1)
    except BaseException:
        # Exiting normally would wait in jax.distributed's shutdown barrier for processes
        # that may be stuck in a collective with this one; leave at once instead.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _bound(name: str, default: Any) -> Any:
    """The value gin binds to `name`, or `default`."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def parse_command_line(argv: list[str], run_name: str, parents=()) -> argparse.Namespace:
    """Parses T5X-style flags and loads the gin configuration they name.

    Flags: --gin_file (repeatable; searched in the working directory, --gin_search_paths and
    the repository's configs/), --gin.NAME=VALUE (repeatable bindings, applied after the
    files), --gin_search_paths=DIR[,DIR...], --tfds_data_dir=DIR (bound to
    `<run_name>.tfds_data_dir`); --multiprocess [--coordinator_address=HOST:PORT
    --process_count=N --process_index=I] [--initialization_timeout=SECONDS] (see `main`);
    `parents`: the entry point's own flags (`command_line.parser`, --help lists them too).
    """
    parser = command_line.parser(run_name, parents)
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if not a.startswith("--gin.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    addresses = (args.coordinator_address, args.process_count, args.process_index)
    if not args.multiprocess and any(a is not None for a in addresses):
        parser.error(
            "--coordinator_address, --process_count and --process_index need --multiprocess"
        )
    bindings = [command_line.binding(flag) for flag in rest]
    if args.tfds_data_dir:
        bindings.append(f"{run_name}.tfds_data_dir = {args.tfds_data_dir!r}")
    load_config(args.gin_file, bindings, args.gin_search_paths.split(","))
    # gin does not notice a macro left at %gin.REQUIRED (it passes a bare `object()` on, which
    # fails far from the cause, e.g. "expected str ... not object"); name it here instead.
    check_macros_referenced([flag[len("--gin.") :].split("=", 1)[0] for flag in rest])
    missing = unbound_required()
    if missing:
        raise ValueError(
            f"required gin bindings not set: {', '.join(missing)}; pass them as "
            + " ".join(f"--gin.{name}=VALUE" for name in missing)
            + " (the run file's header lists what each one is)"
        )
    return args


def _macro_references(value: Any, found: set[str]) -> set[str]:
    """Adds the names of the macros `value` (a bound value, possibly nested) refers to."""
    if isinstance(value, gin.config.ConfigurableReference):
        scoped = value._scoped_selector  # 'NAME/gin.macro' for %NAME.
        if scoped.endswith("/gin.macro"):
            found.add(scoped[: -len("/gin.macro")].rsplit("/", 1)[-1])
    elif isinstance(value, dict):
        for item in value.values():
            _macro_references(item, found)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _macro_references(item, found)
    return found


def check_macros_referenced(names: list[str]) -> None:
    """Raises ValueError naming each macro of `names` (bound on the command line) that no
    binding refers to (%NAME).

    gin accepts `--gin.TRAIN_STEP=2` (a typo of TRAIN_STEPS) as a new macro nothing reads, so
    the run would silently train the default number of steps; the closest macro that is
    referenced is named instead. (Config files may bind macros a later binding makes unused,
    e.g. STUDENT when train.student is bound directly, so only the command line's are checked.)
    """
    config = gin.config._CONFIG
    referenced: set[str] = set()
    for bindings in config.values():
        _macro_references(bindings, referenced)
    unused = sorted({n for n in names if "." not in n and "/" not in n} - referenced)
    if unused:
        raise ValueError(command_line.unused_macros_message(unused, referenced))


_REQUIRED_BINDING = re.compile(r"^([\w./]+) = %gin\.REQUIRED$", re.MULTILINE)


def unbound_required() -> list[str]:
    """Macros (and parameters) the parsed configuration still binds to %gin.REQUIRED."""
    return _REQUIRED_BINDING.findall(gin.config_str())


_UNKNOWN_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named")


def _parameter_names(name: str) -> list[str]:
    """Parameters of the registered configurable `name` (a function's or a class's __init__)."""
    fn = gin.get_configurable(name)
    fn = fn.__init__ if isinstance(fn, type) else fn
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind not in skip and p.name != "self"]


def load_config(files: list[str], bindings: list[str], search_paths: list[str] = ()) -> None:
    """Registers configurables, adds search paths (configs/ last) and parses files + bindings."""
    register_configurables()
    # gin also looks configs up as files inside Python packages, and takes a directory of the
    # working directory named like an include's folder (the quickstart's runs/ for
    # `include 'runs/distill.gin'`) for a namespace package, then crashes. Our configs are
    # plain files: keep gin's plain-file reader only.
    gin.config._FILE_READERS[:] = [(open, os.path.isfile)]
    for path in [p for p in search_paths if p] + [str(CONFIGS_DIR), str(CONFIGS_DIR.parent)]:
        gin.add_config_file_search_path(path)
    try:
        gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    except ValueError as e:
        # gin names the unknown parameter but not the valid ones; add them.
        match = _UNKNOWN_PARAMETER.search(str(e))
        if match is None:
            raise
        name = match.group(1).rsplit("/", 1)[-1]
        raise ValueError(f"{e}\n  Valid parameters of {name}: {_parameter_names(name)}") from e


def binds(selector: str) -> bool:
    """Whether the parsed configuration binds `selector` (e.g. 'recipes.output_dir')."""
    unset = object()
    return _bound(selector, unset) is not unset


def config_str() -> str:
    """The whole parsed configuration, as written to MODEL_DIR/config.gin."""
    return gin.config_str()


def configured(name: str, scope_name: str | None = None) -> Any:
    """Calls the registered configurable `name` (e.g. 'distillspec.models.T5Config') with the
    parsed bindings, those under `scope_name/` in force; for code that must not import gin."""
    with gin.config_scope(scope_name):
        return gin.get_configurable(name)()


def clear() -> None:
    """Forgets every binding (configurables stay registered), before parsing a new config."""
    gin.clear_config()
