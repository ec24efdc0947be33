"""The manifest of a sharded checkpoint: what was saved, in which layout, and each file's checksum."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from hybrid.core import BucketPlan, FlatShardPlan, shard_flat

FORMAT = "hybrid-checkpoint"
FORMAT_VERSION = 3
# Version 1 had no manifest binding (below); it is still read, with a warning. Versions 1 and 2
# hold one SHA-256 per file (the whole file is hashed before a load); version 3 a checksum of each
# file's header, which holds a checksum per chunk of its data (``_shard_file.py``).
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
# The key, in each shard file's safetensors metadata, of the digest of the manifest's body.
BODY_DIGEST_KEY = "hybrid.manifest_body_sha256"
# The run state's key for the rebuilt bucket plan of the hybrid DDP that saved (and its layout
# settings): what load(..., restore_buckets=True) restores and torch_ready_order reads.
DDP_PLAN_KEY = "ddp_buckets"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupt, from another model or format."""


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def shard_file_rank(name: str) -> int | None:
    """The rank whose shard file ``name`` is (None: not a shard file's name)."""
    m = re.fullmatch(r"rank-(\d+)-of-\d+\.safetensors", name)
    return None if m is None else int(m.group(1))


@dataclasses.dataclass(frozen=True)
class OptimizerInfo:
    """The optimizer a checkpoint's state belongs to, in framework-neutral terms.

    ``slots`` name the per-element state saved beside the parameters (``"mu"``, ``"nu"``: Adam's
    first and second moments, torch's ``exp_avg`` / ``exp_avg_sq``; ``"trace"``: momentum,
    torch's ``momentum_buffer``). ``count`` is the number of optimizer steps taken (optax's
    ``count``, torch's per-parameter ``step``).
    """

    name: str
    slots: tuple[str, ...]
    count: int
    hyperparameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What torch holds per parameter, where it is not "every slot, ``count`` steps": parameters
    # with no state yet (never stepped; their slots are zeros on disk and are not restored), step
    # counts per parameter name when they differ, and the parameters a slot covers when it covers
    # only some (AMSGrad's ``max_nu`` in AMSGrad groups only).
    without_state: tuple[str, ...] = ()
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    slot_params: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def has_state(self, name: str) -> bool:
        return name not in self.without_state

    def holds(self, slot: str, name: str) -> bool:
        """Whether parameter ``name`` has slot ``slot`` (torch: the state key exists)."""
        return self.has_state(name) and (slot not in self.slot_params or name in self.slot_params[slot])

    def count_of(self, name: str) -> int:
        return self.counts.get(name, self.count)

    def to_json(self) -> dict:
        d = {"name": self.name, "slots": list(self.slots), "count": self.count,
             "hyperparameters": self.hyperparameters}
        if self.without_state:
            d["without_state"] = list(self.without_state)
        if self.counts:
            d["counts"] = dict(self.counts)
        if self.slot_params:
            d["slot_params"] = {k: list(v) for k, v in self.slot_params.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "OptimizerInfo":
        return cls(d["name"], tuple(d["slots"]), int(d["count"]), dict(d.get("hyperparameters", {})),
                   tuple(d.get("without_state", ())), {k: int(v) for k, v in d.get("counts", {}).items()},
                   {k: tuple(v) for k, v in d.get("slot_params", {}).items()})


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One rank's file: its name, size in bytes and checksum.

    Format 3: ``header_xxh3_128``, the XXH3-128 of the file's safetensors header (the 8 length
    bytes and the JSON), which records the XXH3-128 of every chunk of the data. Formats 1 and 2:
    ``sha256``, the SHA-256 of the whole file.
    """

    name: str
    rank: int
    nbytes: int
    sha256: str | None = None
    header_xxh3_128: str | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything needed to read a checkpoint back into any layout.

    ``plan`` is the bucket plan the shards were cut from (``shard_flat(plan, world_size)``);
    ``dtypes`` the dtype of every saved tensor key (``"params/0"``, ``"mu/0"``, ...).
    """

    framework: str
    world_size: int
    stage: int | None
    step: int
    plan: BucketPlan
    optimizer: OptimizerInfo | None
    dtypes: dict[str, str]
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Replicated module buffers (BatchNorm statistics ...), saved once in rank 0's file as
    # ``buffers/NAME`` (flat): name -> {"shape": [...], "dtype": "float32"}.
    buffers: dict[str, dict] = dataclasses.field(default_factory=dict)
    # The rest of a run: {"scheduler": an LR scheduler's state_dict(), "state": the user's JSON}.
    run_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The version it was written as (FORMAT_VERSION for a new one). It is in the body its files
    # record, so an older checkpoint's digest is recomputed as it was written, and an edited
    # version number is caught like any other edited field.
    format_version: int = dataclasses.field(default=FORMAT_VERSION, compare=False)

    @property
    def shards(self) -> FlatShardPlan:
        return shard_flat(self.plan, self.world_size)

    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": self.format_version, "framework": self.framework,
                "world_size": self.world_size, "stage": self.stage, "step": self.step,
                "plan": self.plan.to_json(), "plan_fingerprint": self.plan.fingerprint(),
                "shard_fingerprint": self.shards.fingerprint(),
                "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
                "dtypes": self.dtypes, "files": [f.to_json() for f in self.files], "metadata": self.metadata,
                "buffers": self.buffers, "run_state": self.run_state}

    def tensor_dtypes(self) -> dict[str, str]:
        """The dtype of every tensor key of the files: the buckets' and the buffers' (``buffers/NAME``)."""
        return {**self.dtypes, **{f"buffers/{n}": e["dtype"] for n, e in self.buffers.items()}}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def body_digest(self) -> str:
        """SHA-256 of everything in the manifest but its file list, in canonical JSON.

        Every shard file records it, so the files' checksums (which the manifest holds) also
        vouch for the manifest's other fields: an edited ``step``, ``optimizer.count``,
        hyperparameter or metadata no longer matches what the files say. The file list is left
        out because it is only known once the files are written; its names are checked against
        the plan and its sizes and checksums against the files themselves.

        >>> from hybrid.core import TensorSpec, plan_buckets
        >>> m = Manifest("numpy", 1, None, 3, plan_buckets([TensorSpec("w", (2,), "float32")]), None, {}, ())
        >>> m.body_digest() == dataclasses.replace(m, step=4).body_digest()
        False
        """
        body = {k: v for k, v in self.to_json().items() if k != "files"}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @classmethod
    def loads(cls, text: str, *, where: str) -> "Manifest":
        """Parse and check a manifest; ``where`` (its path) is named in every error."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{where}: not valid JSON ({e})") from None
        fmt = d.get("format") if isinstance(d, dict) else None
        if fmt != FORMAT:
            raise CheckpointError(f"{where}: not a hybrid checkpoint manifest (format {fmt!r}, expected {FORMAT!r})")
        version = d.get("format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointError(f"{where}: format version {version!r} is not supported by this hybrid "
                                  f"(it reads versions {list(READABLE_VERSIONS)}); save it again with a matching hybrid")
        try:
            plan = BucketPlan.from_json(d["plan"])
            manifest = cls(d["framework"], int(d["world_size"]), d["stage"], int(d["step"]), plan,
                           None if d["optimizer"] is None else OptimizerInfo.from_json(d["optimizer"]),
                           dict(d["dtypes"]), tuple(FileEntry(**f) for f in d["files"]), dict(d.get("metadata", {})),
                           dict(d.get("buffers", {})), dict(d.get("run_state", {})), format_version=int(version))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
        if plan.fingerprint() != d.get("plan_fingerprint"):
            raise CheckpointError(f"{where}: the plan does not match its fingerprint "
                                  f"({plan.fingerprint()} vs {d.get('plan_fingerprint')!r}): the manifest was edited")
        checksum = "header_xxh3_128" if manifest.format_version >= 3 else "sha256"
        unchecked = [f.rank for f in manifest.files if not isinstance(getattr(f, checksum), str)]
        if unchecked:
            raise CheckpointError(f"{where} was edited after the save: format version {manifest.format_version} "
                                  f"records the {checksum} of every file, the files of ranks {unchecked} have none")
        ranks = sorted(f.rank for f in manifest.files)
        if ranks != list(range(manifest.world_size)):
            raise CheckpointError(f"{where}: lists files for ranks {ranks}, expected one per rank "
                                  f"0..{manifest.world_size - 1}")
        for f in manifest.files:
            # The loader opens exactly these names inside the checkpoint directory: a name such as
            # '../x' or '/etc/passwd' in a downloaded checkpoint must never make it open other files.
            if f.name != shard_file_name(f.rank, manifest.world_size):
                raise CheckpointError(f"{where}: the file of rank {f.rank} is named {f.name!r}; a checkpoint's "
                                      f"files are named {shard_file_name(f.rank, manifest.world_size)!r} and "
                                      f"live in its directory: refusing to open anything else")
        return manifest
