"""hybrid.torch.measure_collectives over 2 gloo ranks: what the probe times and what the fitted
model holds (no timing is asserted: tests/torch/test_cost_model.py compares the model with steps).

From 1 MiB on a round also times mixed trains (each collective behind one of the smallest size),
so the model holds a gap after a small collective at those sizes, never below the same-size gap,
and the same-size gap below them; every rank fits the same model."""

from tests._procs import forkserver_ranks

SIZES = (1 << 12, 1 << 16, 1 << 20, 2 << 20)


def _measure(tmp, rank, port, out):
    import datetime
    import os

    import torch
    import torch.distributed as dist

    os.environ["HYBRID_CACHE_DIR"] = tmp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from hybrid.torch import measure_collectives
        from hybrid.torch._cost_probe import Prober

        prober = Prober(None, ("all_reduce",), SIZES, torch.device("cpu"))
        shapes = [(nbytes, len(train), None if mixed is None else [int(b.numel()) * 4 for b, _ in mixed])
                  for _, nbytes, train, mixed in prober.cases]
        model = measure_collectives(sizes=SIZES, reps=1, kinds=("all_reduce", "broadcast"))
        again = measure_collectives(sizes=SIZES, reps=1, kinds=("all_reduce", "broadcast"))  # from the cache
        out.put((rank, {"shapes": shapes, "model": model.to_json(), "same": again == model}, 0.0))
    except BaseException as e:  # report instead of hanging the test
        out.put((rank, repr(e), 0.0))
    finally:
        dist.destroy_process_group()


def test_the_probe_times_mixed_trains_and_the_model_keeps_their_gaps(tmp_path):
    from hybrid.core import CostModel

    reports, _ = forkserver_ranks(_measure, (str(tmp_path),), 2, world=2, wait_s=120)
    outcomes = [reports[r][0] for r in range(2)]
    assert all(isinstance(o, dict) for o in outcomes), outcomes
    shapes = outcomes[0]["shapes"]
    # a train per size; a mixed train from 1 MiB on: big, small, big, ..., big
    assert [(n, k) for n, k, _ in shapes] == [(1 << 12, 32), (1 << 16, 32), (1 << 20, 4), (2 << 20, 4)]
    assert [m for *_, m in shapes] == [None, None, [1 << 20, 4096] * 3 + [1 << 20], [2 << 20, 4096] * 3 + [2 << 20]]
    models = [CostModel.from_json(o["model"]) for o in outcomes]
    assert models[0] == models[1] and all(o["same"] for o in outcomes)
    for kind in ("all_reduce", "broadcast"):
        fit = models[0].fits[kind]
        assert fit.sizes == SIZES and len(fit.after_small) == len(SIZES)
        assert fit.after_small[:2] == fit.gaps[:2]  # no mixed trains below 1 MiB
        assert all(a >= g for a, g in zip(fit.after_small, fit.gaps))
        assert models[0].gap_after_small(kind, 2 << 20) == fit.after_small[-1]
    assert models[0].about["probe"] == "isolated+trains+mixed"
