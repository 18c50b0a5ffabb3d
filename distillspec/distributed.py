"""Multi-process runs: start-up, agreement between processes, and preemption.

JAX runs one Python process per host (or per GPU), each driving its own devices; all of them
run the same program on global arrays (multi-controller). `initialize` connects the processes
(`jax.distributed.initialize`, with explicit addresses or the cluster JAX detects: Cloud TPU VM
metadata, SLURM, Open MPI) and must run before anything touches the JAX backend.
`check_same_everywhere` stops a run whose processes were started with different settings;
`fetch` brings global arrays to every host; `PreemptionWatcher` turns SIGTERM into a
checkpoint at a step boundary that every process agrees on.

In a single process (no `initialize`) every function here is a cheap no-op or local operation.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (T5X's flags; None = detect from the cluster)."""

    coordinator_address: str | None = None  # 'host:port' of process 0's coordination service.
    process_count: int | None = None  # Processes in the run.
    process_index: int | None = None  # This process, in [0, process_count).
    initialization_timeout: int = 300  # Seconds to wait for the coordinator and every process.

    def __post_init__(self):
        if not (isinstance(self.initialization_timeout, int) and self.initialization_timeout >= 1):
            raise ValueError(
                "initialization_timeout must be an integer number of seconds >= 1, got "
                f"{self.initialization_timeout!r}"
            )
        if self.process_count is not None and self.process_count < 1:
            raise ValueError(f"process_count must be >= 1, got {self.process_count}")
        if self.process_index is not None and not (
            self.process_index >= 0
            and (self.process_count is None or self.process_index < self.process_count)
        ):
            raise ValueError(
                f"process_index must be in [0, process_count={self.process_count}), "
                f"got {self.process_index}"
            )
        if self.coordinator_address is not None:
            _host_port(self.coordinator_address)

    @property
    def explicit(self) -> bool:
        """All three addresses given (no cluster detection)."""
        return None not in (self.coordinator_address, self.process_count, self.process_index)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def check_mesh_fits(mesh_shape: Sequence[int], process_count: int) -> None:
    """Raises ValueError if a (data, model) mesh cannot be split evenly over the processes."""
    devices = math.prod(mesh_shape)
    if devices % process_count:
        raise ValueError(
            f"train.mesh_shape = {tuple(mesh_shape)} has {devices} devices, which "
            f"--process_count={process_count} processes cannot share evenly; use a mesh whose "
            f"size is process_count x (devices per process)"
        )


def _wait_for_coordinator(config: DistributedConfig, deadline: float) -> None:
    """Fails clearly (in Python) if nothing listens at the coordinator's address in time."""
    host, port = _host_port(config.coordinator_address)
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"process {config.process_index} of {config.process_count}: the coordinator "
                    f"at {config.coordinator_address} did not answer within "
                    f"--initialization_timeout={config.initialization_timeout} s ({e}). Start "
                    "process 0 (--process_index=0) with the same --coordinator_address, check "
                    "the host, port and firewall, or raise --initialization_timeout."
                ) from None
            time.sleep(0.2)


def _give_up(config: DistributedConfig) -> None:
    # JAX aborts the process (a C++ fatal error) when registration times out; say why first.
    print(
        f"error: the {config.process_count or 'expected'} processes did not all join the "
        f"coordinator at {config.coordinator_address or '(detected)'} within "
        f"--initialization_timeout={config.initialization_timeout} s. Every process needs the "
        "same --coordinator_address and --process_count and its own --process_index.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def initialize(config: DistributedConfig, mesh_shape: Sequence[int] | None = None) -> None:
    """Joins the multi-process run; call once, before anything touches the JAX backend.

    Args:
      config: the addresses; those left None are detected by JAX from the cluster (Cloud TPU
        VM metadata, SLURM, Open MPI environment variables).
      mesh_shape: the run's (data, model) mesh, checked against process_count before
        connecting when the count is known.

    Raises:
      TimeoutError: a coordinator that does not answer within the timeout.
      ValueError: a mesh the processes cannot share, or addresses neither given nor detected.
    """
    if mesh_shape is not None and config.process_count is not None:
        check_mesh_fits(mesh_shape, config.process_count)
    deadline = time.monotonic() + config.initialization_timeout
    if config.explicit and config.process_index > 0:
        _wait_for_coordinator(config, deadline)
    remaining = max(1.0, deadline - time.monotonic())
    watchdog = threading.Timer(remaining, _give_up, args=(config,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.process_count,
            process_id=config.process_index,
            # JAX's own deadline comes after the watchdog's, which explains itself.
            initialization_timeout=int(remaining) + 30,
        )
    except ValueError as e:
        raise ValueError(
            f"{e}: --multiprocess needs --coordinator_address, --process_count and "
            "--process_index, or a cluster JAX detects (Cloud TPU VM, SLURM, Open MPI)"
        ) from e
    finally:
        watchdog.cancel()
    if mesh_shape is not None:
        check_mesh_fits(mesh_shape, jax.process_count())


def is_primary() -> bool:
    """Process 0: the one that writes logs, config.gin and exports."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (no-op in one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _gather_text(text: str) -> list[str]:
    """Every process's `text`, in process order."""
    data = np.frombuffer(text.encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.array([data.size], np.int64))[:, 0]
    padded = np.zeros(int(lengths.max()) or 1, np.uint8)
    padded[: data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    return [bytes(row[:n]).decode() for row, n in zip(np.asarray(gathered), lengths)]


def _difference(name: str, values: list[str]) -> str:
    odd = next(i for i, v in enumerate(values) if v != values[0])
    if "\n" not in values[0] + values[odd]:
        listing = ", ".join(f"process {i} has {v!r}" for i, v in enumerate(values))
        return f"{name}: {listing}"
    diff = difflib.unified_diff(
        values[0].splitlines(), values[odd].splitlines(), "process 0", f"process {odd}", n=0
    )
    lines = [line for line in diff if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    return f"{name} differs between process 0 and process {odd}:\n    " + "\n    ".join(lines[:8])


def check_same_everywhere(values: Mapping[str, str]) -> None:
    """Raises ValueError naming each of `values` that differs between processes.

    Every process must call it with the same names (it is a collective: one gather of digests,
    and of the texts that differ only then); a single process returns at once.
    """
    if jax.process_count() == 1:
        return
    texts = {name: str(value) for name, value in values.items()}
    digests = b"".join(hashlib.sha256(text.encode()).digest() for text in texts.values())
    gathered = np.asarray(multihost_utils.process_allgather(np.frombuffer(digests, np.uint8)))
    differs = (gathered != gathered[0]).reshape(len(gathered), len(texts), -1).any(axis=(0, 2))
    problems = [
        _difference(name, _gather_text(text))
        for (name, text), odd in zip(texts.items(), differs)
        if odd
    ]
    if problems:
        raise ValueError(
            "the processes of this run were started with different settings; every process "
            "must run the same command (only --process_index differs):\n  " + "\n  ".join(problems)
        )


def fetch(tree: Any) -> Any:
    """`tree` as host numpy arrays on every process (a collective for global arrays)."""
    leaves, treedef = jax.tree.flatten(tree)
    spread = {
        i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable
    }
    out = [None if i in spread else jax.device_get(x) for i, x in enumerate(leaves)]
    if spread:
        order = sorted(spread)
        gathered = multihost_utils.process_allgather([leaves[i] for i in order], tiled=True)
        for i, value in zip(order, gathered):
            out[i] = np.asarray(value)
    return jax.tree.unflatten(treedef, out)


class PreemptionWatcher:
    """Has a preemption (SIGTERM) been requested? Every process gets the same answer per step.

    Multi-process: JAX's preemption service (started by jax.distributed.initialize) catches
    SIGTERM in any process and agrees with the others on a step to stop at; orbax's
    `CheckpointManager.reached_preemption(step)` asks it. It must be asked at every step, by
    every process. A single process installs its own SIGTERM handler while the watcher is open.

    Example:
      with PreemptionWatcher(ckpt.reached_preemption) as watcher:
          for step in ...:
              if watcher.requested(step):
                  save and stop
    """

    def __init__(self, sync_point: Callable[[int], bool]):
        self._sync_point = sync_point
        self._signalled = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        del signum, frame
        self._signalled = True

    def __enter__(self) -> PreemptionWatcher:
        main_thread = threading.current_thread() is threading.main_thread()
        if not jax.distributed.is_initialized() and main_thread:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def requested(self, step: int) -> bool:
        """True at the step all processes stop at, once any of them was asked to stop."""
        return self._sync_point(step) or self._signalled

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
