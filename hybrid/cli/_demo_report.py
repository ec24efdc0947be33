"""What ``python -m hybrid demo`` prints and draws: the model, both plans, the losses, their parity."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid.cli._demo_options import DemoOptions
from hybrid.cli._table import format_table, human_bytes

# Per step the losses agree within tests/parity's tolerance (float32 computed in two orders).
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
# The MLP's final parameters too. The GPT's are reported, not judged: Adam moves every element by
# up to ~lr a step whatever its gradient's size, and some of its gradients are rounding noise on
# both sides (the attention's key bias: softmax cancels it, its gradient is 0 in exact arithmetic),
# so those elements walk apart by a fraction of lr a step (1.4e-4 after the default 40 steps, 3.7e-4
# after 120) while the loss, which they do not change, still agrees to 1e-6 (docs/moving-runs.md).
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)


def print_model(config, params: dict, options: DemoOptions) -> None:
    count = sum(a.size for a in params.values())
    if config.gpt is None:
        print(f"Model: the twin MLP {'-'.join(map(str, config.sizes))} (hybrid.demo), {count:,} parameters in "
              f"{len(params)} tensors, the same numpy init on both sides.")
        rows = f"{options.batch_size} rows"
    else:
        g = config.gpt
        print(f"Model: hybrid.models' GPT pair (torch TorchGPT, flax FlaxGPT): {g.n_layer} blocks of {g.n_head} heads, "
              f"width {g.n_embd}, {g.vocab_size} tokens; {count:,} parameters in {len(params)} tensors. Both start "
              f"from torch's init, crossed to flax's names and layouts by hybrid.models.GPT_MAPPING.")
        rows = f"a synthetic token stream, {options.batch_size} rows of {config.seq_len} tokens"
    caps = ("ZeRO3's default plan (hybrid.core.zero3_plan: a cap of 1/16 of the parameters, within 1 and 25 MiB)"
            if config.stage == 3 else "torch's defaults (1 MiB first bucket, then 25 MiB)")
    print(f"Data: {rows} per step (seed {config.seed}), split evenly over {options.world_size} ranks / devices. "
          f"Bucket caps: {caps} on both sides.\n")


def _names(plan, bucket) -> str:
    names = [plan.specs[m].name for m in bucket.members]
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} .. {names[-1]}"


def print_plans(torch_run, jax_run, world_size: int, stage: int = 1) -> bool:
    """Both frameworks' bucket plans, one table (they are equal) and the fingerprints; True if equal."""
    from hybrid.core import shard_flat

    plan = torch_run.plan
    shards = shard_flat(plan, world_size)
    rows = [[b, len(bucket.members), _names(plan, bucket), bucket.length, human_bytes(bucket.nbytes),
             " ".join(f"[{lo}:{hi})" for _, lo, hi in (shards.rank_shards(r)[b] for r in range(world_size)))]
            for b, bucket in enumerate(plan.buckets)]
    if stage == 3:
        print("Buckets: torch ZeRO3's (hybrid.core.zero3_plan over torch's registration order), and hybrid.jax."
              "shard_params' over the same tensors by torch's names and order; each rank holds its flat shard:")
    else:
        print("Buckets: torch's DDP after its rebuild (gradient-ready order), and hybrid.jax.zero planned from the "
              "order its own backward computes the gradients:")
    print(format_table(["bucket", "tensors", "tensors, in bucket order (torch's names)", "elements", "bytes",
                        f"flat shard of ranks 0..{world_size - 1}"], rows))
    same = torch_run.plan_fingerprint == jax_run.plan_fingerprint and torch_run.plan == jax_run.plan
    per_bucket = " + ".join(str(len(b.members)) for b in plan.buckets)
    print(f"Tensors per bucket: {per_bucket}. Plan fingerprints: torch {torch_run.plan_fingerprint}, "
          f"jax {jax_run.plan_fingerprint} ({'equal' if same else 'DIFFERENT'})")
    return same


def print_losses(torch_run, jax_run, resumed, save_at: int) -> None:
    rows = []
    steps = len(torch_run.losses)
    shown = range(steps) if steps <= 60 else sorted(set(range(0, steps, max(1, steps // 20))) | {save_at, steps - 1})
    for i in shown:
        r = resumed.losses[i - save_at] if i >= save_at else None
        rows.append([i, f"{torch_run.losses[i]:.6f}", f"{jax_run.losses[i]:.6f}",
                     f"{abs(torch_run.losses[i] - jax_run.losses[i]):.1e}",
                     "" if r is None else f"{r:.6f}", "" if r is None else f"{abs(r - torch_run.losses[i]):.1e}"])
    print(format_table(["step", "torch", "jax", "|torch-jax|", "jax, resumed", "|resumed-torch|"], rows))


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    return max((float(np.max(np.abs(a[k] - b[k]))), k) for k in a)


def print_parity(config, torch_run, jax_run, resumed, options: DemoOptions) -> str | None:
    """The parity and hand-over figures; None if all agree within the tolerances, else why not."""
    t, j, r = torch_run.losses, jax_run.losses, resumed.losses
    tail = slice(options.save_at, None)
    loss_diff = float(np.max(np.abs(t - j)))
    params_diff, worst = _max_diff(torch_run.params, jax_run.params)
    print(f"Parity over {options.steps} steps: max |torch - jax| of the loss {loss_diff:.1e} "
          f"(relative {float(np.max(np.abs(t - j) / np.abs(t))):.1e}); of the final parameters {params_diff:.1e} "
          f"(in {worst})")
    if config.gpt is not None:
        print("  (judged on the losses: Adam turns gradients that are rounding noise on both sides, like the attention "
              "key bias's, into steps of up to lr; docs/moving-runs.md)")
    r_torch, r_jax = _max_diff(torch_run.params, resumed.params)[0], _max_diff(jax_run.params, resumed.params)[0]
    print(f"Hand-over: JAX on {options.resume_world_size} devices resumed torch's step-{options.save_at} checkpoint; "
          f"against the uninterrupted runs, steps {options.save_at}..{options.steps - 1}:")
    print(f"  loss max |resumed - torch| {float(np.max(np.abs(r - t[tail]))):.1e}, "
          f"|resumed - jax| {float(np.max(np.abs(r - j[tail]))):.1e}; final parameters max |resumed - torch| "
          f"{r_torch:.1e}, |resumed - jax| {r_jax:.1e}")
    every = np.concatenate([t, j, r])
    if not np.isfinite(every).all():
        return f"training diverged (a loss is not finite): try a smaller --lr than {options.lr}"
    for name, other, losses in (("jax", jax_run, j), ("jax resumed", resumed, r)):
        if not np.allclose(losses, t[len(t) - len(losses):], **LOSS_TOL):
            return f"torch's and {name}'s losses differ beyond rtol {LOSS_TOL['rtol']} / atol {LOSS_TOL['atol']}"
        if config.gpt is None and not all(np.allclose(torch_run.params[k], other.params[k], **PARAM_TOL)
                                          for k in torch_run.params):
            return (f"torch's and {name}'s final parameters differ beyond rtol {PARAM_TOL['rtol']} / "
                    f"atol {PARAM_TOL['atol']}")
    return None


def _positive(d: np.ndarray) -> tuple[np.ndarray, int]:
    """``d`` with exact zeros as NaN (a log scale has no 0), and how many there were."""
    return np.where(d > 0, d, np.nan), int(np.sum(d == 0))


def plot(path: Path, torch_run, jax_run, resumed, options: DemoOptions) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, par) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = np.arange(len(torch_run.losses))
    later = steps[options.save_at:]
    ax.plot(steps, torch_run.losses, label=f"torch: DDP + ZeRO-{options.stage}, {options.world_size} ranks", lw=2.5, alpha=0.6)
    ax.plot(steps, jax_run.losses, "--", label=f"JAX: zero stage {options.stage}, {options.world_size} devices")
    ax.plot(later, resumed.losses, ":", lw=2.5, label=f"JAX, {options.resume_world_size} devices, resumed from torch's checkpoint")
    for a in (ax, par):
        a.axvline(options.save_at, color="grey", lw=0.8)
        a.set_xlabel("step")
    ax.annotate("checkpoint", (options.save_at, ax.get_ylim()[1]), ha="left", va="top", fontsize=8, color="grey")
    ax.set_ylabel("cross-entropy (global batch)")
    ax.set_title(f"hybrid: one plan, two frameworks ({options.model})")
    ax.legend(fontsize=8)
    for x, d, style, label in ((steps, np.abs(torch_run.losses - jax_run.losses), "o-", "|torch - JAX|"),
                               (later, np.abs(resumed.losses - torch_run.losses[options.save_at:]), "s:",
                                f"|JAX resumed on {options.resume_world_size} - torch|")):
        y, zeros = _positive(d)
        par.semilogy(x, y, style, ms=3,
                     label=label + (f" ({zeros} step{'s' * (zeros > 1)} exactly 0, not drawn)" if zeros else ""))
    # float32 spacing at the loss's size: the differences are a few roundings of the last bit
    ulp = float(np.spacing(np.float32(np.median(torch_run.losses))))
    par.axhline(ulp, color="grey", lw=0.8, ls="--", label=f"1 float32 ulp at loss {np.median(torch_run.losses):.1f}")
    par.set_ylabel("|difference| of the loss (log scale)")
    par.set_title("parity per step: the curves on the left overlap")
    par.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
