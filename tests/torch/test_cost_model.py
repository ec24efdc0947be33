"""The measured cost model predicts the step communication of the bench models (issue 25.1).

Each world size probes its gloo process group the way hybrid.torch.measure_collectives does (every
collective at 4 KiB - 32 MiB, alone and in back-to-back trains) and, in the same rounds, times each
bench model's step communication as hybrid issues it on gloo: DDP's all-reduce of every bucket,
back to back (at torch's default caps, and with every gradient its own bucket), and ZeRO-2's
all-reduces followed by every rank's broadcast of its slices. Probe and steps interleave, round
after round, so both see the same machine load; the slowest rank's time counts for both.

The prediction is CostModel.fit over the probe's samples (medians per size, interpolated; a
train's collectives cost their gap, the first its isolated time, one behind a smaller collective
up to its gap after a small one, from the probe's mixed trains) run through stream_ends. Two
ratios of predicted to measured: of the medians over all rounds (the model as measure_collectives
builds it), and paired, the median over rounds of each round's model against the same round's
steps (how the project's benchmarks cancel a load that drifts). The test holds the paired ratio
to 20%, the issue's bound: it asks whether the model's form (isolated time, gaps, interpolation)
predicts what the steps cost, which a machine whose load changes between rounds cannot tell from
the ratio of medians. Both print; docs/benchmarks.md has figures under load.

A ratio can be held to 20% only where the rounds agree with each other to about that: a row whose
per-round ratios spread wider (their middle half more than 1.25x from end to end: the run's A/A
noise) is not judged. The rows that can be judged are asserted; if some could not, the test then
skips, naming them and their spread (a machine shared with other jobs; CI runs the suite alone).

It runs when HYBRID_COST_VALIDATION=1 is set: on this project's 2-core machines it does not pass
on every run (13 of 16 runs on an idle machine judged no row outside 20%; three failed on one row
each, and the 2-rank train of 200 all-reduces scatters up to 3.6x between rounds: docs/benchmarks.md),
so it is not part of the default run, where it would fail or skip at random. Issue 25 stays open
on it.
"""

import os
import statistics

import pytest

from hybrid.core import CostModel
from tests._procs import forkserver_ranks
from tests.torch._workers_cost import measure_and_compare

ROUNDS = 7
NOISE = 1.25  # the widest middle half of per-round ratios a 20% bound can be judged against


@pytest.mark.skipif(os.environ.get("HYBRID_COST_VALIDATION") != "1",
                    reason="cost-model validation needs a quiet machine: set HYBRID_COST_VALIDATION=1 (issue 25.1)")
@pytest.mark.parametrize("world", [2, 3])
def test_predicted_step_communication_within_20_percent(world):
    reports, _ = forkserver_ranks(measure_and_compare, (world, ROUNDS), world, world=world, wait_s=170)
    outcomes = [reports[r][0] for r in range(world)]
    assert all(isinstance(o, dict) for o in outcomes), outcomes
    models = {CostModel.from_json(o["model"]).fingerprint() for o in outcomes}
    assert len(models) == 1  # every rank fitted the same slowest-rank times
    rows = outcomes[0]["rows"]
    for r in rows.values():
        r["paired"] = statistics.median(r["rounds"])
        q1, _, q3 = statistics.quantiles(r["rounds"], n=4, method="inclusive")
        r["spread"] = q3 / q1
    print(f"\nworld {world}: predicted / measured step communication, paired (of medians) [noise] {{ms}}: "
          + ", ".join(f"{k} {r['paired']:.2f} ({r['predicted'] / r['measured']:.2f}) [{r['spread']:.2f}] "
                      f"{{{r['measured'] * 1e3:.1f}}}" for k, r in rows.items()))
    model = CostModel.from_json(outcomes[0]["model"])
    for kind in ("all_reduce", "broadcast"):  # what the rows were predicted from (.ci/quiet keeps it)
        print(f"world {world} model {kind}, MiB: alone / gap / gap after a small one, ms: " + ", ".join(
            f"{n / 2**20:g}: {model.seconds(kind, n) * 1e3:.2f} / {model.gap(kind, n) * 1e3:.2f} / "
            f"{model.gap_after_small(kind, n) * 1e3:.2f}" for n in model.fits[kind].sizes if n > 1 << 19))
    judged = {k: r for k, r in rows.items() if r["spread"] <= NOISE}
    bad = {k: round(r["paired"], 3) for k, r in judged.items() if not 0.8 <= r["paired"] <= 1.2}
    assert not bad, f"paired predicted / measured outside [0.8, 1.2]: {bad} (all: {rows})"
    noisy = {k: round(r["spread"], 2) for k, r in rows.items() if k not in judged}
    if noisy:
        pytest.skip(f"world {world}: {len(judged)} rows within 20%; too noisy to judge (middle half of the per-round "
                    f"ratios, end over start): {noisy}")
