"""Checkpoint formats as plug-ins: the registry finds each by name, formats never import the
dispatcher back, a new format is a module and one registration line, and the quick commands
import only what the format at hand needs (``checkpoint info`` of hybrid's own format imports
neither torch nor JAX, of a DCP torch but never JAX or orbax)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hybrid.checkpoint import _formats, convert, detect_format, open_checkpoint, save_arrays
from hybrid.checkpoint._plugin import CheckpointFormat
from tests.test_layout import ROOT, import_graph

DISPATCHER = {"hybrid.checkpoint", "hybrid.checkpoint._formats", "hybrid.checkpoint._convert"}
HEAVY = ("torch", "jax", "jaxlib", "orbax", "optax", "flax")


def _format_modules(graph) -> list[str]:
    """Every module of a format's plug-in: hybrid's own, and dcp/ and orbax/ but their package
    ``__init__`` (the public face, which re-exports ``write_dcp`` / ``write_orbax`` from the
    dispatcher by name, as a user's script would import them)."""
    return sorted(m for m in graph if m == "hybrid.checkpoint._hybrid_format" or (
        m.startswith(("hybrid.checkpoint.dcp.", "hybrid.checkpoint.orbax."))))


def test_formats_never_import_the_dispatcher_back():
    graph = import_graph()
    modules = _format_modules(graph)
    assert "hybrid.checkpoint.dcp._format" in modules and "hybrid.checkpoint.orbax._reader" in modules
    reached = {}
    for start in modules:
        seen, todo = set(), [start]
        while todo:
            for v in graph.get(todo.pop(), ()):
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        if seen & DISPATCHER:
            reached[start] = sorted(seen & DISPATCHER)
    assert not reached, f"format modules that reach the dispatcher (lazy imports included): {reached}"


def test_the_registry_imports_formats_only_by_name():
    tree = ast.parse((ROOT / "checkpoint" / "_formats.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    formats = {_formats._MODULES[name] for name in _formats.registered()}
    assert not imported & formats and not any(m.startswith(("hybrid.checkpoint.dcp", "hybrid.checkpoint.orbax"))
                                              for m in imported)


@pytest.mark.parametrize("name", _formats.FORMATS)
def test_each_format_implements_the_interface(name):
    fmt = _formats.format_named(name)
    assert isinstance(fmt, CheckpointFormat) and fmt.name == name and fmt.signature
    for method in ("detect", "open", "writer"):
        assert getattr(type(fmt), method) is not getattr(CheckpointFormat, method), f"{name} lacks {method}"


def test_unknown_format_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="format='safetensors'; hybrid reads and writes"):
        _formats.format_named("safetensors")
    with pytest.raises(ValueError, match="convert: to='npz'; hybrid writes"):
        convert(tmp_path / "a", tmp_path / "b", to="npz")


@pytest.fixture
def npz_registered(monkeypatch):
    """The registry with the test's format added by its one line (undone after the test)."""
    monkeypatch.setattr(_formats, "_MODULES", dict(_formats._MODULES))
    monkeypatch.setattr(_formats, "_LOADED", dict(_formats._LOADED))
    _formats.register("npz", "tests.checkpoint_formats._npz_format")


def test_a_new_format_is_one_registration_line(tmp_path, npz_registered):
    """The toy format of ``_npz_format`` goes through every path a built-in one does: detected,
    opened, converted into and back out of hybrid's own, bit for bit."""
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1.5, -2.0], np.float32)}
    save_arrays(tmp_path / "h", arrays, step=7, world_size=2)
    done = convert(tmp_path / "h", tmp_path / "n", to="npz")
    assert (done.source_format, done.format, done.step, done.num_tensors) == ("hybrid", "npz", 7, 2)
    assert detect_format(tmp_path / "n") == "npz" and "npz" in _formats.registered()
    convert(tmp_path / "n", tmp_path / "back", to="hybrid", world_size=3)
    back = open_checkpoint(tmp_path / "back")
    assert (back.format, back.manifest.step, back.manifest.world_size) == ("hybrid", 7, 3)
    for name, value in back.tensors("params").items():
        assert value.dtype == arrays[name].dtype and np.array_equal(value, arrays[name]), name
    with pytest.raises(ValueError, match="already registered"):
        _formats.register("npz", "somewhere.else")


# Runs the command line, then says on stderr which heavy packages the process imported.
_CLI = """
import json, sys
from hybrid.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
    heavy += ["torch.distributed.checkpoint"] * ("torch.distributed.checkpoint" in sys.modules)
    print("IMPORTED " + json.dumps([code, heavy]), file=sys.stderr)
"""


def _imported_by(*commands) -> list:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CLI, json.dumps(commands), json.dumps(HEAVY)], env=env,
                         capture_output=True, text=True, timeout=300)
    lines = [json.loads(line[len("IMPORTED "):]) for line in out.stderr.splitlines() if line.startswith("IMPORTED ")]
    assert len(lines) == len(commands), out.stderr
    return lines


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_quick_commands_import_what_the_format_needs(tmp_path):
    """One process runs, in turn: info and a convert of hybrid's own (a torch run's, with AdamW
    state): nothing heavy; then info and a convert to hybrid of a DCP: torch, never JAX, optax or
    orbax, nor torch.distributed.checkpoint (its metadata is read into plain records: the package
    import costs as much again as torch's); then a convert to DCP, which saves with it."""
    import torch

    from hybrid.checkpoint import torch as ckpt_torch
    from hybrid.checkpoint.dcp import write_dcp

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ckpt_torch.save(tmp_path / "h", model, opt, step=1)
    write_dcp(tmp_path / "h", tmp_path / "dcp")
    h, d = str(tmp_path / "h"), str(tmp_path / "dcp")
    steps = _imported_by(["checkpoint", "info", h],
                         ["checkpoint", "convert", h, str(tmp_path / "h2"), "--to", "hybrid"],
                         ["checkpoint", "info", d],
                         ["checkpoint", "convert", d, str(tmp_path / "h3"), "--to", "hybrid"],
                         ["checkpoint", "convert", h, str(tmp_path / "d2"), "--to", "dcp"])
    assert steps == [[0, []], [0, []], [0, ["torch"]], [0, ["torch"]], [0, ["torch", "torch.distributed.checkpoint"]]]


def test_orbax_info_imports_no_torch(tmp_path):
    """info of an orbax checkpoint imports JAX and orbax (its arrays are read with orbax's
    restore), never torch, optax or flax."""
    from hybrid.checkpoint.orbax import write_orbax

    save_arrays(tmp_path / "h", {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, step=2)
    write_orbax(tmp_path / "h", tmp_path / "o")
    assert _imported_by(["checkpoint", "info", str(tmp_path / "o")]) == [[0, ["jax", "jaxlib", "orbax"]]]
