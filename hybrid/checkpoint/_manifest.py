"""The manifest of a sharded checkpoint: what was saved, in which layout, and each file's checksum."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hybrid.core import BucketPlan, FlatShardPlan, shard_flat

FORMAT = "hybrid-checkpoint"
FORMAT_VERSION = 2
# Version 1 had no manifest binding (below); it is still read, with a warning.
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
# The key, in each shard file's safetensors metadata, of the digest of the manifest's body.
BODY_DIGEST_KEY = "hybrid.manifest_body_sha256"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupt, from another model or format."""


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


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

    def to_json(self) -> dict:
        return {"name": self.name, "slots": list(self.slots), "count": self.count,
                "hyperparameters": self.hyperparameters}

    @classmethod
    def from_json(cls, d: dict) -> "OptimizerInfo":
        return cls(d["name"], tuple(d["slots"]), int(d["count"]), dict(d.get("hyperparameters", {})))


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One rank's file: its name, size in bytes and SHA-256."""

    name: str
    rank: int
    nbytes: int
    sha256: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


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
    # The version it was read as (a new manifest is written as FORMAT_VERSION); not part of the body.
    format_version: int = dataclasses.field(default=FORMAT_VERSION, compare=False)

    @property
    def shards(self) -> FlatShardPlan:
        return shard_flat(self.plan, self.world_size)

    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "framework": self.framework,
                "world_size": self.world_size, "stage": self.stage, "step": self.step,
                "plan": self.plan.to_json(), "plan_fingerprint": self.plan.fingerprint(),
                "shard_fingerprint": self.shards.fingerprint(),
                "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
                "dtypes": self.dtypes, "files": [f.to_json() for f in self.files], "metadata": self.metadata}

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
                           int(version))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
        if plan.fingerprint() != d.get("plan_fingerprint"):
            raise CheckpointError(f"{where}: the plan does not match its fingerprint "
                                  f"({plan.fingerprint()} vs {d.get('plan_fingerprint')!r}): the manifest was edited")
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
