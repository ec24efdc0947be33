"""ZeRO-3 for torch: ``ZeRO3`` (``_model``: parameters sharded flat per bucket, gathered while used),
its optimizer (``_optim``) and the parts it is built of: the parameter buckets (``_params``), the
gradient reducer (``_grads``), the hooks' schedule (``_schedule``) and the modules that carry them
(``_units``: what torch.compile sees), the stand-ins (``_shards``), the
meta-device initialisation (``_init``) and the whole-tensor state dicts (``_state``)."""

from hybrid.torch.zero.zero3._model import ZeRO3
from hybrid.torch.zero.zero3._optim import ZeRO3Optimizer
from hybrid.torch.zero.zero3._shards import ParameterInShards

__all__ = ["ParameterInShards", "ZeRO3", "ZeRO3Optimizer"]
