"""What ``_get_ddp_logging_data()`` returns: torch's C++ ``Logger`` (logger.cpp), kept in Python.

Same keys, same values, same moments as torch's, so that tools and tests written for torch's
class read ours unchanged:

- at construction: the constructor's settings, the parameters (count, bytes, dtypes), the buckets'
  sizes, the environment (``MASTER_ADDR``, gloo's or NCCL's settings), ``iteration`` 0;
- at a synchronizing forward (grad enabled, outside ``no_sync()``) whose iteration is sampled
  (iterations 1 to 10, then every ``sample_rate``-th, 100 by default): ``iteration`` (the number
  of earlier synchronizing forwards), the last backward's ``num_buckets_reduced``,
  ``unused_parameter_size`` and gradient-ready order, the buckets once rebuilt, and the host-side
  timings (nanoseconds) of the last sampled iteration with their running averages;
- on events: ``comm_hook`` (the hook's ``__qualname__``), ``join_uneven_inputs``, ``static_graph``,
  ``has_error``/``error`` (with ``iteration`` set to the current count, as torch's
  ``set_error_and_log``), ``can_set_static_graph`` (once per process, as torch's).

The DDP class feeds it facts; which bucket holds what stays ``hybrid.core``'s decision.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

# torch's kDDPRuntimeLoggingSampleRate: after the tenth iteration, one in this many is sampled.
SAMPLE_RATE = 100

# The host-side events torch's reducer timer records (Timer::Event), in its order.
EVENTS = ("forward_start", "backward_compute_start", "backward_compute_end", "backward_comm_start",
          "backward_comm_end")
_UNSET = -1  # torch's kUnsetTime

# (average key, duration key, start event, end event), as logger.cpp's calculate_avg_time calls.
_DURATIONS = (
    ("avg_forward_compute_time", "forward_compute_time", "forward_start", "backward_compute_start"),
    ("avg_backward_compute_time", "backward_compute_time", "backward_compute_start", "backward_compute_end"),
    ("avg_backward_comm_time", "backward_comm_time", "backward_comm_start", "backward_comm_end"),
    ("avg_backward_compute_comm_overlap_time", "backward_compute_comm_overlap_time", "backward_comm_start",
     "backward_compute_end"),
)
_TIMESTAMPS = {"forward_compute_time_start": "forward_start", "backward_compute_time_start": "backward_compute_start",
               "backward_comm_time_start": "backward_comm_start", "backward_compute_time_end": "backward_compute_end",
               "backward_comm_time_end": "backward_comm_end"}

# c10's dtype names, as torch's logger spells them in "dtypes".
_C10_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16"}

# Environment keys by backend: (key, variables, first set wins), as logger.cpp's set_env_variables.
_ENV = (("master_port", ("MASTER_PORT",)), ("master_addr", ("MASTER_ADDR",)),
        ("torch_distributed_debug", ("TORCH_DISTRIBUTED_DEBUG",)), ("cuda_visible_devices", ("CUDA_VISIBLE_DEVICES",)))
_BACKEND_ENV = {
    "nccl": (("nccl_socket_ifname", ("NCCL_SOCKET_IFNAME",)),
             ("nccl_blocking_wait", ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")),
             ("nccl_async_error_handling", ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")),
             ("nccl_debug", ("NCCL_DEBUG",)), ("nccl_nthreads", ("NCCL_NTHREADS",)),
             ("nccl_ib_timeout", ("NCCL_IB_TIMEOUT",))),
    "gloo": (("gloo_socket_ifname", ("GLOO_SOCKET_IFNAME",)), ("gloo_device_transport", ("GLOO_DEVICE_TRANSPORT",))),
}

# torch's log_if_graph_static runs once per process (a function-local static in logger.cpp): at
# the first change of a DDP's unused parameters, or when a DDP's logger is destroyed.
_graph_static_logged = False


def should_collect_runtime_stats(iteration: int, sample_rate: int = SAMPLE_RATE) -> bool:
    """Whether torch's reducer samples runtime stats at ``iteration`` (its ``num_iterations_``):
    iterations 1 to 10, then every ``sample_rate``-th.

    >>> [i for i in range(0, 301) if should_collect_runtime_stats(i)]
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100, 200, 300]
    """
    return iteration > 0 and (iteration <= 10 or iteration % sample_rate == 0)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements, as torch's logger counts them (numel x element size)."""
    return tensor.numel() * tensor.element_size()


def bucket_cap_bytes(layout_settings: dict) -> int:
    """torch's logged ``bucket_bytes_cap``: the largest cap of a list, and a negative cap as it
    is; torch's 25 MB where none is given (and under ``"auto"``, which starts from torch's caps).

    >>> bucket_cap_bytes({"bucket_cap_mb": None, "bucket_cap_mb_list": [1, 4]})
    4194304
    """
    caps_mb = layout_settings["bucket_cap_mb_list"] or [layout_settings["bucket_cap_mb"]]
    cap_mb = 25 if caps_mb in ([None], ["auto"]) else max(caps_mb)
    return int(cap_mb * 1024 * 1024)


def _env(names) -> str:
    return next((os.environ[n] for n in names if n in os.environ), "N/A")


def _join(values, sep: str = ", ") -> str:
    return sep.join(map(str, values))


class DDPLogger:
    """torch's DDP ``Logger``: the logging data of one DDP, filled as torch fills it.

    >>> log = DDPLogger()
    >>> log.set_comm_hook("allreduce_hook")
    >>> log.set_error_and_log("<class 'TypeError'>: Communication hook must be callable.", iteration=0)
    >>> sorted(log.data().items())
    [('comm_hook', 'allreduce_hook'), ('error', "<class 'TypeError'>: Communication hook must be callable."), \
('has_error', 1), ('iteration', 0)]
    """

    def __init__(self) -> None:
        self._ints: dict[str, int] = {}
        self._strs: dict[str, str] = {}
        self.sample_rate = SAMPLE_RATE
        self._num_recorded = 0  # torch's num_iterations_stats_recorded_
        self._times = dict.fromkeys(EVENTS, _UNSET)

    def data(self) -> dict:
        """The dictionary ``_get_ddp_logging_data()`` returns: strings, then integers, each by key
        (torch merges its two sorted maps the same way)."""
        return {**dict(sorted(self._strs.items())), **dict(sorted(self._ints.items()))}

    def should_collect(self, iteration: int) -> bool:
        return should_collect_runtime_stats(iteration, self.sample_rate)

    def record(self, event: str) -> None:
        """The host time of ``event`` now, in nanoseconds since the epoch (torch's CpuTimer)."""
        self._times[event] = time.time_ns()

    def set_construction_data(self, *, module_name: str, device_ids, output_device, broadcast_buffers: bool,
                              has_sync_bn: bool, static_graph: bool, process_group, params, bucket_sizes,
                              bucket_cap_bytes: int, find_unused_parameters: bool,
                              gradient_as_bucket_view: bool) -> None:
        """torch's ``set_construction_data_and_log``: what is known when DDP is built."""
        if static_graph:
            self.set_static_graph()
        backend = dist.get_backend(process_group)
        self._strs.update(module_name=module_name, bucket_sizes=_join(bucket_sizes),
                          dtypes=_join(sorted({_C10_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
                          device_ids=_join(device_ids or []), backend_name=backend)
        self._ints.update(world_size=dist.get_world_size(process_group), rank=dist.get_rank(process_group),
                          iteration=0, is_multi_device_module=int(len({p.device for p in params}) > 1),
                          num_parameter_tensors=len(params), total_parameter_size_bytes=sum(map(nbytes, params)),
                          output_device=-1 if output_device is None else int(output_device),
                          broadcast_buffers=int(broadcast_buffers), has_sync_bn=int(has_sync_bn),
                          bucket_cap_bytes=bucket_cap_bytes, find_unused_parameters=int(find_unused_parameters),
                          gradient_as_bucket_view=int(gradient_as_bucket_view))
        for key, names in _ENV + _BACKEND_ENV.get(backend, ()):
            self._strs[key] = _env(names)
        if backend == "gloo":
            self._ints["gloo_num_threads"] = process_group._get_backend(torch.device("cpu")).options._threads

    def set_runtime_stats_and_log(self, *, iteration: int, num_buckets_reduced: int, unused_parameter_size: int,
                                  has_rebuilt_buckets: bool, buckets, grad_ready_order) -> None:
        """torch's ``set_runtime_stats_and_log``, at a synchronizing forward: nothing unless
        ``iteration`` (the synchronizing forwards so far) is sampled. ``buckets()`` gives the
        buckets in use as (sizes in bytes, member indices); ``grad_ready_order`` is the order in
        which the last reduced backward's gradient hooks fired (empty: left as logged)."""
        if not self.should_collect(iteration):
            return
        self._num_recorded += 1
        ints, strs = self._ints, self._strs
        ints.update(iteration=iteration, num_buckets_reduced=num_buckets_reduced,
                    unused_parameter_size=unused_parameter_size)
        # The buckets in use are logged once, when the rebuild is first seen.
        if ints.setdefault("has_rebuilt_buckets", 0) != int(has_rebuilt_buckets):
            ints["has_rebuilt_buckets"] = int(has_rebuilt_buckets)
            sizes, members = buckets()
            strs["rebuilt_bucket_sizes"] = _join(sizes)
            strs["rebuilt_per_bucket_param_indices"] = _join(_join(m, " ") for m in members)
        if grad_ready_order:
            strs["prev_iteration_grad_ready_order_indices"] = _join(grad_ready_order)
        for _, duration, _, _ in _DURATIONS:
            ints[duration] = 0
        for key in _TIMESTAMPS:
            ints[key] = 0
        times, n = self._times, self._num_recorded
        for avg, duration, start, end in _DURATIONS:
            ints.setdefault(avg, 0)
            if times[end] >= times[start]:  # else not measured in that iteration: the average stays
                ints[duration] = times[end] - times[start]
                ints[avg] = (ints[duration] + ints[avg] * (n - 1)) // n
        for key, event in _TIMESTAMPS.items():
            if times[event] != _UNSET:
                ints[key] = times[event]

    def set_comm_hook(self, name: str) -> None:
        self._strs["comm_hook"] = name

    def set_uneven_input_join(self) -> None:
        self._ints["join_uneven_inputs"] = 1

    def set_static_graph(self) -> None:
        self._ints["static_graph"] = 1

    def set_error_and_log(self, error: str, *, iteration: int) -> None:
        """An error DDP raises: ``has_error``, its text, and the iteration it was raised in."""
        self._ints.update(has_error=1, iteration=iteration)
        self._strs["error"] = error

    def log_if_graph_static(self, is_static: bool, *, iteration: int) -> None:
        """``can_set_static_graph`` and the current ``iteration``, once per process (torch's)."""
        global _graph_static_logged
        if not _graph_static_logged:
            _graph_static_logged = True
            self._ints.update(can_set_static_graph=int(is_static), iteration=iteration)

    def __del__(self):
        # torch's ~Logger logs whether the graph stayed static, into the dying logger: the
        # process's one chance is gone, so a later DDP never shows can_set_static_graph.
        global _graph_static_logged
        _graph_static_logged = True


def record_construction(logger: DDPLogger, ddp) -> None:
    """torch's construction-time logging data of ``ddp`` (its ``_ddp_init_helper``'s ``set_construction_data``)."""
    logger.set_construction_data(
        module_name=type(ddp.module).__name__, device_ids=ddp.device_ids, output_device=ddp.output_device,
        broadcast_buffers=ddp.forward_sync_buffers,
        has_sync_bn=any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()),
        static_graph=ddp.static_graph, process_group=ddp.process_group, params=ddp._params,
        bucket_sizes=ddp._reducer.buckets.param_bytes()[0], bucket_cap_bytes=bucket_cap_bytes(ddp._layout_settings),
        find_unused_parameters=ddp.find_unused_parameters, gradient_as_bucket_view=ddp.gradient_as_bucket_view)
