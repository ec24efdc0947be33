"""ZeRO-1 saves, whose ranks each hold whole tensors' state: every element of a rank's file comes
from the one rank holding it (the checkpoint plan follows the owners; only what lies across a
slice cut is sent), checked against the union of the ranks' own states."""

import numpy as np

from hybrid.checkpoint import Checkpoint


def _overlap_worker(root, rank, port, out):
    """hybrid's ZeroRedundancyOptimizer stepping inside DDP's comm hook: trained, saved, loaded
    into a fresh run and saved again before it steps (every rank then holds all the loaded state,
    pending for the hook's first plan)."""
    import pathlib

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from hybrid.checkpoint import torch as ckpt_torch
    from tests._procs import init_gloo
    from hybrid.torch import DistributedDataParallel, ZeroRedundancyOptimizer, hook_with_zero_step

    init_gloo(rank, port)
    try:
        def build():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32),
                                        torch.nn.Linear(32, 8))
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
            zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-2)
            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero, shard_buckets=True,
                                                             update_from_first_iteration=True))
            return model, ddp, zero

        model, ddp, zero = build()
        for step in range(4):
            torch.manual_seed(100 + 2 * step + rank)
            ddp(torch.randn(8, 64)).pow(2).mean().backward()
            zero.zero_grad()
        everyone = [None, None]
        dist.all_gather_object(everyone, zero._overlap_local_state()["state"])
        ckpt_torch.save(pathlib.Path(root) / "trained", ddp, zero, step=4)
        _, ddp2, zero2 = build()
        ckpt_torch.load(pathlib.Path(root) / "trained", ddp2, zero2)
        ckpt_torch.save(pathlib.Path(root) / "again", ddp2, zero2, step=4)
        if rank == 0:
            union = {}
            for states in everyone:
                union.update(states)
            names = [n for n, _ in model.named_parameters()]
            np.savez(pathlib.Path(root) / "union.npz", **{f"{s}:{names[i]}": st[key].numpy() for i, st in union.items()
                                                          for s, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq"))})
        out.put((rank, "saved", 0.0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}", 0.0))
    finally:
        dist.destroy_process_group()


def test_overlap_zero1_save_holds_each_state_once(tmp_path):
    """A save right after a load used to sum the state over the ranks that all held it (doubled)."""
    from tests._procs import forkserver_ranks

    reports, _ = forkserver_ranks(_overlap_worker, (str(tmp_path),), 2, wait_s=120)
    assert {r: outcome for r, (outcome, _) in reports.items()} == {0: "saved", 1: "saved"}
    union = np.load(tmp_path / "union.npz")
    trained, again = Checkpoint(tmp_path / "trained"), Checkpoint(tmp_path / "again")
    for slot in ("mu", "nu"):
        for name, value in trained.tensors(slot).items():
            np.testing.assert_array_equal(value, union[f"{slot}:{name}"], err_msg=f"{slot} {name}")
        for name, value in again.tensors(slot).items():
            np.testing.assert_array_equal(value, union[f"{slot}:{name}"], err_msg=f"again: {slot} {name}")
    assert len(union.files) == 2 * len(trained.manifest.plan.specs)
