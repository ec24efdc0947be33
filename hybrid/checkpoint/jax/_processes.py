"""A save from every process of a ``jax.distributed`` job: each process writes the files of the
ranks it holds, process 0 writes the manifest last, under the protocol of ``_protocol.py``.

The processes agree through the key-value store of the coordination service that
``jax.distributed.initialize`` starts (the one orbax's multi-host barriers use), never through an
XLA collective: every wait there has a deadline, so a process that died, stalled, or never called
``save`` becomes an error naming it instead of a hang. One save, its keys under
``hybrid.checkpoint/save-N/`` (N counts the saves, the same in every process):

==================================================  =========================================
process 0: protocol steps 1-3 (``begin_save``)       posts ``begun``
every process: waits for ``begun``, writes its files  posts ``files/P``: their entries, the
                                                     manifest digest they were written for
process 0: waits for every ``files/P``, checks them,  posts ``done``: the file list
commits (steps 5-9: manifest, swap)
every other process: waits for ``done``
==================================================  =========================================

A process that fails posts its error in place of its value, so the others raise at once with
its message; one that dies is named when the deadline passes. Nothing is committed unless every
process's files are in place, so until ``done`` the path holds the previous checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from hybrid.core import BucketPlan
from hybrid.checkpoint._files import write_shard
from hybrid.checkpoint._manifest import FileEntry, Manifest, OptimizerInfo
from hybrid.checkpoint._protocol import abandon_save, begin_save, commit_save, staging
from hybrid.checkpoint._write import buffer_entries, check_json, dtypes_of, rank_tensors

PREFIX = "hybrid.checkpoint"
# Every process calls save the same number of times (as with orbax), so the n-th save has the
# same key in all of them without a message.
_SAVES = itertools.count()
# Process 0 gives up on a silent process at the deadline and posts why; the others wait this much
# longer for process 0, so they raise with its reason (naming the silent process), not their own.
GRACE_S = 10.0


def _client():
    from jax._src import distributed  # the coordination service's client: public JAX has no handle on it

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(f"{jax.process_count()} JAX processes, but jax.distributed is not initialized in this "
                           f"one: a multi-process save agrees through jax.distributed's coordination service")
    return client


class _Agreement:
    """The keys of one save, and waits on them that end with an error naming who did not answer."""

    def __init__(self, path, timeout_s: float):
        self.client, self.path, self.timeout_s = _client(), path, timeout_s
        self.number = next(_SAVES)
        self.key = f"{PREFIX}/save-{self.number}"
        self.deadline = time.monotonic() + timeout_s

    def post(self, name: str, value: dict) -> None:
        try:
            self.client.key_value_set(f"{self.key}/{name}", json.dumps(value))
        except jax.errors.JaxRuntimeError as e:
            raise self.error(f"process {jax.process_index()} could not post {name!r} to jax.distributed's "
                             f"coordination service, which runs in process 0 (did process 0 die?)", e) from None

    def fail(self, name: str, error: BaseException) -> None:
        """Post ``error`` in place of ``name``'s value, so the processes waiting for it raise now.

        Process 0 then waits a little for the others to say they read it: the coordination
        service lives in process 0, and if it exits (its error ends the script) before they have
        read the error, JAX terminates them instead of letting them raise it.
        """
        text = str(error).removeprefix(f"saving checkpoint {self.path}: ")
        self.post(name, {"error": f"process {jax.process_index()}: {type(error).__name__}: {text}"})
        if jax.process_index() == 0:
            self._linger()

    def _linger(self) -> None:
        end = time.monotonic() + min(GRACE_S, max(self.deadline - time.monotonic(), 0.0) + 1.0)
        for p in range(1, jax.process_count()):
            ms = int((end - time.monotonic()) * 1000)
            if ms <= 0:
                return
            try:
                self.client.blocking_key_value_get(f"{self.key}/read-error/{p}", ms)
            except jax.errors.JaxRuntimeError:
                return  # that process died or is still busy: it will meet the deadline or the error later

    def error(self, what: str, cause=None) -> RuntimeError:
        tail = f". Cause: {str(cause).splitlines()[0]}" if cause is not None else ""  # gRPC adds lines of detail
        return RuntimeError(f"saving checkpoint {self.path}: {what}{tail}")

    def wait(self, name: str, process: int, doing: str, after: str) -> dict:
        """The value posted as ``name`` by ``process``; raises the error posted instead, or one naming
        ``process`` once the save's deadline passes (``after``: what the path holds then)."""
        deadline = self.deadline + (GRACE_S if process == 0 else 0.0)
        ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            value = json.loads(self.client.blocking_key_value_get(f"{self.key}/{name}", ms))
        except jax.errors.JaxRuntimeError as e:  # DEADLINE_EXCEEDED, or the service (in process 0) is gone
            silent = self._silent(name, process)
            raise self.error(f"process {', '.join(map(str, silent))} did not {doing} within timeout_s="
                             f"{self.timeout_s:g} s (it died, stalled, or did not call save: every process "
                             f"must call it with the same arguments); {after}", e) from None
        if "error" in value:
            if jax.process_index() != 0:
                try:  # tell process 0 it can go (see fail)
                    self.client.key_value_set(f"{self.key}/read-error/{jax.process_index()}", "1")
                except jax.errors.JaxRuntimeError:
                    pass
            raise self.error(value["error"])
        return value

    def _silent(self, name: str, process: int) -> list[int]:
        """The processes that have not posted under ``name``'s folder (``files/P``), or ``process``."""
        if not name.startswith("files/"):
            return [process]
        try:
            posted = {int(k.rsplit("/", 1)[1]) for k, _ in self.client.key_value_dir_get(f"{self.key}/files/")}
        except jax.errors.JaxRuntimeError:
            return [process]
        return [p for p in range(1, jax.process_count()) if p not in posted] or [process]

    def forget_previous(self) -> None:
        """Drop the keys of the save before this one: every process posted here, so all have left it."""
        if self.number:
            try:
                self.client.key_value_delete(f"{PREFIX}/save-{self.number - 1}")
            except jax.errors.JaxRuntimeError:
                pass  # a few stale keys in the service's memory; the save itself is committed


def save_across_processes(path: str | os.PathLike, body: Manifest, ranks: list[int],
                          contents: Callable[[int], dict[str, list[np.ndarray]]], *, timeout_s: float) -> Manifest:
    """Write rank files ``ranks`` (``contents(r)``, in parallel) from this process, and the
    manifest ``body`` with every process's file entries from process 0; returns the manifest (in
    every process), once it is in place.

    Every process of the job must call it, with the same ``body``; each rank of
    ``body.world_size`` must be written by exactly one process. ``timeout_s`` bounds the whole
    save: a process that has not answered by then is named in a RuntimeError.
    """
    agree = _Agreement(path, timeout_s)
    me, digest = jax.process_index(), body.body_digest()
    untouched = "nothing was committed: the path holds the previous checkpoint"
    if me == 0:
        try:
            begin_save(path)
        except BaseException as e:
            agree.fail("begun", e)
            raise
        agree.post("begun", {})
    else:
        agree.wait("begun", 0, "start the save (protocol steps 1-3)", untouched)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(ranks), 8))) as pool:
            mine = list(pool.map(lambda r: write_shard(path, r, body.world_size, contents(r), body_digest=digest,
                                                         dtypes=body.tensor_dtypes()),
                                 ranks))
    except BaseException as e:
        agree.fail("done" if me == 0 else f"files/{me}", e)  # where the others wait for this process
        for rank in [None] if me == 0 else ranks:  # process 0 began the save: it removes the whole staging
            abandon_save(path, own_rank=rank)
        raise
    entries = [e.to_json() for e in mine]
    if me != 0:
        agree.post(f"files/{me}", {"digest": digest, "files": entries})
        after = ("if process 0 died while committing, the path holds the previous checkpoint or this one; "
                 "either is complete")
        done = agree.wait("done", 0, "commit the manifest", after)
        return dataclasses.replace(body, files=tuple(FileEntry(**f) for f in done["files"]))
    try:
        for p in range(1, jax.process_count()):
            theirs = agree.wait(f"files/{p}", p, "report its files", untouched)
            if theirs["digest"] != digest:
                raise agree.error(f"process {p} wrote its files for another manifest than process 0's (another "
                                  f"step, state, metadata, hyperparameters or plan): every process must call save "
                                  f"with the same arguments; {untouched}")
            entries += theirs["files"]
        files = tuple(sorted((FileEntry(**f) for f in entries), key=lambda f: f.rank))
        _check_files(agree, path, files, body.world_size, untouched)
        manifest = dataclasses.replace(body, files=files)
        commit_save(path, manifest)
    except BaseException as e:
        agree.fail("done", e)
        abandon_save(path)  # nothing committed (or it is, and there is nothing staged left)
        raise
    agree.post("done", {"files": [f.to_json() for f in files]})
    agree.forget_previous()
    return manifest


def _check_files(agree: _Agreement, path, files: tuple[FileEntry, ...], world_size: int, untouched: str) -> None:
    """Every rank written once, and every file where process 0 can see it (one shared file system)."""
    ranks = [f.rank for f in files]
    if ranks != list(range(world_size)):
        raise agree.error(f"the processes wrote the files of ranks {ranks}, expected each of 0..{world_size - 1} "
                          f"once; {untouched}")
    for f in files:
        file = staging(path) / f.name
        if not file.is_file() or file.stat().st_size != f.nbytes:
            raise agree.error(f"{file} (rank {f.rank}) was written by another process but process 0 does not see "
                              f"it: every process must save to one shared file system; {untouched}")


def save_from_processes(path: str | os.PathLike, *, plan: BucketPlan, world_size: int, step: int, ranks: list[int],
                        flat_kinds: Sequence[str] = (), flats: Mapping[int, Mapping[str, list[np.ndarray]]] = {},
                        arrays: Mapping[str, Sequence[np.ndarray]] = {}, stage: int | None = None,
                        optimizer: OptimizerInfo | None = None, metadata: dict | None = None,
                        buffers: Mapping[str, np.ndarray] | None = None, run_state: dict | None = None,
                        timeout_s: float) -> Manifest:
    """:func:`hybrid.checkpoint._write.save_sharded` for one process of many: this process writes
    the files of ``ranks``, from its slices of the padded flat buckets (``flats[rank][kind][b]``
    for each of ``flat_kinds``) and from whole arrays every process holds
    (``arrays[kind][spec_index]``), in stored dtypes. The files are the bytes ``save_sharded``
    writes for the same state."""
    kinds = [*flat_kinds, *arrays]  # every process names all kinds, whichever slices it holds
    buffer_meta, buffer_tensors = buffer_entries(buffers or {})
    body = Manifest("jax", world_size, stage, int(step), plan, optimizer, dtypes_of(plan, kinds), (),
                    dict(metadata or {}), buffer_meta, check_json(run_state or {}, "run state"))

    def contents(rank):
        tensors = {f"{kind}/{b}": [piece] for kind, per_bucket in flats.get(rank, {}).items()
                   for b, piece in enumerate(per_bucket)}
        tensors |= rank_tensors(plan, world_size, rank, arrays=arrays)
        return {**tensors, **buffer_tensors} if rank == 0 else tensors

    return save_across_processes(path, body, ranks, contents, timeout_s=timeout_s)
