"""Format 3: a checksum per MiB of each shard file's data, so a reader checks exactly what it reads.

Every byte a load uses is checked against its chunk's checksum as it is read (in the memory it is
used from); bytes a rank does not read are not read at all. Formats 1 and 2 still load.
"""

import hashlib
import json
import pathlib
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hybrid.checkpoint import Checkpoint, CheckpointError, Manifest, OptimizerInfo, save_arrays
from hybrid.checkpoint._manifest import BODY_DIGEST_KEY
from hybrid.checkpoint._shard_file import CHUNK_BYTES, CHUNK_DIGESTS_KEY

# 3 MiB of parameters + 6 MiB of Adam slots over 2 ranks: each file spans several chunks.
N = 3 * CHUNK_BYTES // 4


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    params = {"a": rng.normal(size=N // 2).astype(np.float32),
              "b": rng.normal(size=(N // 4, 2)).astype(np.float32),
              "c": rng.normal(size=7).astype(np.float32)}
    slots = {s: {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for s in ("mu", "nu")}
    return params, slots


@pytest.fixture
def saved(tmp_path):
    params, slots = _arrays()
    path = tmp_path / "ckpt"
    save_arrays(path, params, world_size=2, step=3, slots=slots, optimizer=OptimizerInfo("adam", ("mu", "nu"), 3))
    return path, params, slots


def _header(path, rank):
    data = (path / f"rank-{rank:05d}-of-00002.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), 8 + n


def _flip(path, rank, key, element):
    """Flip one bit of element ``element`` of tensor ``key`` (float32) in rank ``rank``'s file;
    returns the byte's offset in the data region."""
    file = path / f"rank-{rank:05d}-of-00002.safetensors"
    header, data_start = _header(path, rank)
    at = header[key]["data_offsets"][0] + 4 * element
    data = bytearray(file.read_bytes())
    data[data_start + at] ^= 0x01
    file.write_bytes(bytes(data))
    return at


def test_a_rank_checks_only_what_it_reads(saved):
    """A corrupt byte of nu: the parameters (in other chunks) still load; nu is refused, its bytes named."""
    path, params, _ = saved
    at = _flip(path, 1, "nu/0", 1000)
    assert _header(path, 1)[0]["params/1"]["data_offsets"][1] <= at // CHUNK_BYTES * CHUNK_BYTES
    ckpt = Checkpoint(path)
    got = ckpt.tensors("params")
    assert all(np.array_equal(got[k], v) for k, v in params.items())
    lo = at // CHUNK_BYTES * CHUNK_BYTES
    with pytest.raises(CheckpointError, match=rf"rank-00001-of-00002\.safetensors: bytes {lo}\.\.\d+ of its data "
                                              rf"differ from their checksum \(chunk {lo // CHUNK_BYTES} of \d+\): the "
                                              rf"file is corrupt"):
        ckpt.tensors("nu")


def test_a_read_checks_the_whole_chunks_it_touches(saved):
    """Ranges cut anywhere read right. A corrupt byte beside a range, in a chunk the range touches,
    is found (the rest of the chunk is read aside for its checksum); one in another chunk is not read."""
    path, _, _ = saved
    ckpt = Checkpoint(path)
    start, stop = _header(path, 0)[0]["mu/0"]["data_offsets"]
    n = (stop - start) // 4
    whole = ckpt.read(0, "mu/0", 0, n)
    rng = np.random.default_rng(1)
    for _ in range(20):
        lo, hi = sorted(int(x) for x in rng.integers(0, n + 1, 2))
        np.testing.assert_array_equal(ckpt.read(0, "mu/0", lo, hi), whole[lo:hi])
    boundary = -(-start // CHUNK_BYTES) * CHUNK_BYTES  # the first chunk boundary inside mu/0
    assert start < boundary < stop - 16
    first = (boundary - start) // 4  # mu/0's first element in that chunk
    _flip(path, 0, "mu/0", first + 1)
    np.testing.assert_array_equal(ckpt.read(0, "mu/0", 0, first), whole[:first])  # the chunks before
    with pytest.raises(CheckpointError, match=rf"bytes {boundary}\.\.\d+ of its data differ from their checksum"):
        ckpt.read(0, "mu/0", first + 2, first + 3)  # beside the flipped byte, in its chunk


def test_a_file_changed_after_verify_is_caught(saved):
    """The bytes checked are the bytes used: a file rewritten between verify() and the read is refused."""
    path, _, _ = saved
    ckpt = Checkpoint(path)
    ckpt.verify()
    _flip(path, 0, "params/0", 5)
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00002\.safetensors: bytes 0\.\.\d+ of its data differ"):
        ckpt.tensors("params")


def test_shard_files_are_plain_safetensors(saved):
    """Any safetensors reader opens the files; the header lists one XXH3-128 per MiB of data."""
    path, _, _ = saved
    ckpt = Checkpoint(path)
    for r in range(2):
        file = path / f"rank-{r:05d}-of-00002.safetensors"
        data = file.read_bytes()
        n = int.from_bytes(data[:8], "little")
        digests = json.loads(data[8:8 + n])["__metadata__"][CHUNK_DIGESTS_KEY]
        assert len(digests) == 32 * -(-(len(data) - 8 - n) // CHUNK_BYTES) and len(data) > 2 * CHUNK_BYTES
        loaded = load_file(str(file))
        flat = ckpt.manifest.shards
        for key in ("params/0", "mu/0", "nu/0"):
            lo, hi = flat.shard_range(0, r)
            np.testing.assert_array_equal(loaded[key], ckpt.read(r, key, 0, hi - lo))
    assert "sha256" not in json.loads((path / "manifest.json").read_text())["files"][0]


def _as_format_2(path):
    """Rewrite a checkpoint as format 2 wrote it: a SHA-256 of each whole file in the manifest, the
    files' headers holding the manifest body's digest (format 2's body: format_version 2)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 2
    for f in manifest["files"]:
        del f["header_xxh3_128"]
        f["sha256"] = "not known yet: the body digest leaves the file list out"
    body_digest = Manifest.loads(json.dumps(manifest), where="test").body_digest()
    for f in manifest["files"]:
        shard = path / f["name"]
        save_file(load_file(str(shard)), str(shard), metadata={BODY_DIGEST_KEY: body_digest})
        f["nbytes"] = shard.stat().st_size
        f["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_format_2_checkpoint_still_loads(saved):
    path, params, slots = saved
    _as_format_2(path)
    ckpt = Checkpoint(path)
    assert ckpt.manifest.format_version == 2 and ckpt.manifest.step == 3
    for kind, want in (("params", params), ("mu", slots["mu"]), ("nu", slots["nu"])):
        got = ckpt.tensors(kind)
        assert all(np.array_equal(got[k], v) for k, v in want.items()), kind


def test_format_2_checks_stay(saved):
    """Format 2's own checks: an edited field is refused (the binding), so is a corrupt file (SHA-256)."""
    path, _, _ = saved
    _as_format_2(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["step"] = 4
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="was edited after the save"):
        Checkpoint(path).verify()
    manifest["step"] = 3
    (path / "manifest.json").write_text(json.dumps(manifest))
    Checkpoint(path).verify()
    _flip(path, 1, "params/0", 3)
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002\.safetensors: SHA-256 differs from the manifest's"):
        Checkpoint(path).tensors("params")


def _zero1_worker(path, rank, port, out):
    """A 2-rank ZeRO-1 save; then a byte of Adam's nu that only rank 1 owns is corrupted, and each
    rank loads: rank 0 never reads that chunk, rank 1 does."""
    import torch
    import torch.distributed as dist

    from hybrid.checkpoint import torch as ckpt_torch
    from tests._procs import init_gloo
    from hybrid.torch import DistributedDataParallel, ZeroRedundancyOptimizer

    init_gloo(rank, port)
    try:
        def build():
            torch.manual_seed(0)
            # 4 MiB and 2 MiB weights: ZeRO-1 gives each rank one; every slice spans several chunks.
            ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512)))
            return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)

        ddp, opt = build()
        ddp(torch.randn(4, 1024)).square().mean().backward()
        opt.step()
        ckpt_torch.save(path, ddp, opt, step=1)
        owners = {id(p): r for p, r in opt._param_to_rank.items()}
        assert owners[id(ddp.module[1].weight)] == 1 and owners[id(ddp.module[0].weight)] == 0
        if rank == 0:
            header, _ = _header(pathlib.Path(path), 1)
            _flip(pathlib.Path(path), 1, "nu/0", header["nu/0"]["shape"][0] - 1000)  # rank 1's own tensors end there
        dist.barrier()
        other, other_opt = build()
        try:
            ckpt_torch.load(path, other, other_opt)
            outcome = "loaded" if torch.equal(other.module[0].weight, ddp.module[0].weight) else "wrong values"
        except CheckpointError as e:
            outcome = str(e)
        out.put((rank, outcome, 0.0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}", 0.0))
    finally:
        dist.destroy_process_group()


def test_a_zero1_rank_reads_only_the_state_it_owns(tmp_path):
    from tests._procs import forkserver_ranks

    reports, _ = forkserver_ranks(_zero1_worker, (str(tmp_path / "ckpt"),), 2, wait_s=120)
    assert reports[0][0] == "loaded"
    assert re.search(r"rank-00001-of-00002\.safetensors: bytes \d+\.\.\d+ of its data differ from their checksum",
                     reports[1][0]), reports[1][0]
