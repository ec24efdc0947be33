"""What a run needs of a model on the JAX side (:class:`JaxModel`) and the helpers both the MLP's
(``_jax_run``) and the GPT's (``_gpt_jax``) models are built with."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES
from hybrid.demo._model import TrainConfig


def host(x) -> np.ndarray:
    """``x`` as numpy: this process's copy of a replicated array."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


class JaxModel(NamedTuple):
    """What a run needs of a model on the JAX side.

    ``tree(params)``: the parameter tree from numpy arrays by torch's names; ``named(tree)``: back
    (this process's copy), by torch's names in registration order; ``loss(tree, x, y)``: the mean
    cross-entropy of the rows given; ``layout``: how ``hybrid.jax.zero`` plans its buckets
    (``order``, ``ready_order``, ``pairing`` and the caps), which ``hybrid.checkpoint.jax`` needs too.
    """

    tree: Callable
    named: Callable
    loss: Callable
    layout: dict


def bucket_caps(config: TrainConfig) -> dict:
    """The config's caps as ``zero`` takes them: torch's defaults (1 MiB first bucket, then 25
    MiB), or, as torch's DDP does with an explicit ``bucket_cap_mb``, one cap for every bucket.

    >>> bucket_caps(TrainConfig())
    {'bucket_cap_bytes': 26214400, 'first_bucket_cap_bytes': 1048576}
    """
    if config.bucket_cap_bytes is None:
        return dict(bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES, first_bucket_cap_bytes=DEFAULT_FIRST_BUCKET_CAP_BYTES)
    return dict(bucket_cap_bytes=config.bucket_cap_bytes, first_bucket_cap_bytes=config.bucket_cap_bytes)
