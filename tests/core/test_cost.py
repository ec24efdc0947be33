"""The collective cost model and the step simulation (hybrid.core.cost._collectives, _step_cost), against
the textbook formulas worked by hand."""

import math

import pytest

from hybrid.core import (COLLECTIVES, CostModel, Link, STAGES, TensorSpec, collective_seconds, exposed_seconds,
                         plan_buckets, step_cost, stream_ends, wire_bytes)

LINK = Link("test", 1e-5, 1e9)  # 10 us, 1 GB/s


@pytest.mark.parametrize("kind,algorithm,p,n,want", [
    ("all_reduce", "ring", 4, 1e6, 6 * 1e-5 + 1.5 * 1e-3),
    ("all_reduce", "tree", 4, 1e6, 4 * 1e-5 + 2 * 1e-3),
    ("all_reduce", "tree", 5, 1e6, 6 * 1e-5 + 2 * 1e-3),  # ceil(log2 5) = 3 levels
    ("reduce_scatter", "ring", 8, 8e6, 7 * 1e-5 + 7e-3),
    ("all_gather", "tree", 8, 8e6, 7 * 1e-5 + 7e-3),  # no tree: ring
    ("broadcast", "ring", 4, 1e6, 3 * 1e-5 + 1e-3),
    ("broadcast", "tree", 4, 1e6, 2 * (1e-5 + 1e-3)),
    ("all_reduce", "ring", 1, 1e9, 0.0),
])
def test_formulas(kind, algorithm, p, n, want):
    assert collective_seconds(kind, n, p, LINK, algorithm) == pytest.approx(want, rel=1e-12)


def test_default_algorithm_is_the_faster():
    small, big = 1e3, 1e9  # latency-bound: the tree's log steps win; bandwidth-bound: the ring's (p-1)/p
    assert collective_seconds("all_reduce", small, 64, LINK) == collective_seconds("all_reduce", small, 64, LINK, "tree")
    assert collective_seconds("all_reduce", big, 64, LINK) == collective_seconds("all_reduce", big, 64, LINK, "ring")


def test_wire_bytes():
    assert wire_bytes("all_reduce", 100, 4) == 150
    assert wire_bytes("reduce_scatter", 100, 4) == wire_bytes("all_gather", 100, 4) == 75
    assert wire_bytes("broadcast", 100, 4) == 75


def test_fit_recovers_the_constants_through_the_formulas():
    p, link = 3, Link("true", 2e-5, 5e8)
    samples = [(k, n, collective_seconds(k, n, p, link, "ring")) for k in COLLECTIVES for n in (1 << 10, 1 << 20, 1 << 26)]
    model = CostModel.fit(samples, world_size=p, about={"backend": "gloo"})
    for kind in COLLECTIVES:
        got = model.link(kind)
        assert got.latency_s == pytest.approx(2e-5, rel=1e-6) and got.bytes_per_s == pytest.approx(5e8, rel=1e-6)
        assert model.fits[kind].max_rel_error < 1e-9
        assert model.seconds(kind, 12345) == pytest.approx(collective_seconds(kind, 12345, p, link, "ring"), rel=1e-6)
    again = CostModel.from_json(model.to_json())
    assert again == model and again.fingerprint() == model.fingerprint()


def test_fit_refuses_what_cannot_make_a_line():
    with pytest.raises(ValueError, match="two sizes"):
        CostModel.fit([("all_reduce", 1024, 1e-4), ("all_reduce", 1024, 2e-4)], world_size=2)
    with pytest.raises(ValueError, match="unknown collective 'alltoall'"):
        CostModel.fit([("alltoall", 1024, 1e-4)], world_size=2)
    with pytest.raises(ValueError, match="not a CostModel"):
        CostModel.from_json({"kind": "BucketPlan"})


def test_exposed_seconds_waits_on_dependencies_and_names_a_cycle():
    end, exposed = exposed_seconds([("f", 1.0, ()), ("b", 1.0, ("g",))], [("g", 0.5, ("f",))])
    assert (end, exposed) == (2.5, 0.5)  # b waits for the gather: half a second of compute idles
    with pytest.raises(ValueError, match=r"\['a', 'x'\]"):
        exposed_seconds([("a", 1.0, ("x",))], [("x", 1.0, ("a",))])


SPECS = [TensorSpec(f"w{i}", (512, 512), "float32") for i in range(24)]


@pytest.mark.parametrize("p", [2, 8, 64])
def test_step_volumes_follow_the_zero_paper(p):
    plan = plan_buckets(SPECS)
    cost = {s: step_cost(plan, p, s, lambda k, n: collective_seconds(k, n, p, LINK), forward_s=0.0, backward_s=0.0)
            for s in STAGES}
    psi = sum(b.nbytes for b in plan.buckets)
    assert cost["ddp"].wire_bytes == pytest.approx(2 * (p - 1) / p * psi)
    assert cost[2].wire_bytes == pytest.approx(cost["ddp"].wire_bytes)  # reduce-scatter + all-gather
    assert cost[3].wire_bytes == pytest.approx(1.5 * cost["ddp"].wire_bytes)
    assert cost[1].wire_bytes == pytest.approx(1.5 * cost["ddp"].wire_bytes)  # all-reduce + broadcast of shares
    for c in cost.values():  # no compute to hide behind: every second on the wire shows
        assert c.exposed_s == pytest.approx(c.comm_s)


def test_overlap_hides_all_but_the_last_bucket():
    plan = plan_buckets(SPECS)
    per_bucket = 1e-4
    c = step_cost(plan, 4, "ddp", lambda k, n: per_bucket, forward_s=1.0, backward_s=2.0)
    assert c.comm_s == pytest.approx(plan.num_buckets * per_bucket)
    assert c.exposed_s == pytest.approx(per_bucket)  # only the last all-reduce runs after the backward
    assert c.step_s == pytest.approx(3.0 + per_bucket)


def test_zero3_keeps_compute_waiting_for_the_first_gather():
    plan = plan_buckets(SPECS)
    c = step_cost(plan, 4, 3, lambda k, n: 1e-3, forward_s=1.0, backward_s=2.0)
    assert c.exposed_s >= 2e-3  # the first forward gather and the last reduce-scatter cannot hide
    keep = step_cost(plan, 4, 3, lambda k, n: 1e-3, forward_s=1.0, backward_s=2.0, reshard_after_forward=False)
    assert keep.wire_bytes < c.wire_bytes and math.isclose(keep.comm_s, c.comm_s - plan.num_buckets * 1e-3)


def test_step_cost_refuses_bad_input():
    plan = plan_buckets(SPECS)
    with pytest.raises(ValueError, match="stage must be one of"):
        step_cost(plan, 2, 4, lambda k, n: 0.0, forward_s=0.0, backward_s=0.0)
    with pytest.raises(ValueError, match="compute times"):
        step_cost(plan, 2, "ddp", lambda k, n: 0.0, forward_s=-1.0, backward_s=0.0)


def test_measured_group_is_interpolated_through_its_knee():
    # a loopback group: cache speed up to 1 MiB, three times slower per byte past it
    def t(n):
        return 1e-4 + n * 1e-9 if n <= 1 << 20 else 1e-4 + (1 << 20) * 1e-9 + (n - (1 << 20)) * 3e-9
    sizes = (1 << 12, 1 << 20, 1 << 23, 1 << 25)
    model = CostModel.fit([("all_reduce", n, t(n)) for n in sizes for _ in range(3)], world_size=2)
    for n in (1 << 12, 3 << 19, 1 << 22, 5 << 23, 1 << 26):
        assert model.seconds("all_reduce", n) == pytest.approx(t(n), rel=1e-9)
    assert model.seconds("all_reduce", 10) == pytest.approx(t(1 << 12))  # the latency floor
    assert model.fits["all_reduce"].max_rel_error > 0.2  # what one line would have missed by
    assert CostModel.from_json(model.to_json()) == model


def test_gaps_are_what_the_trains_measured_above_or_below_the_isolated_time():
    # 4 KiB: a train of 32 costs 1 ms + 31 x 0.5 ms (contention: more than alone, as 3 gloo ranks
    # on 2 cores measured); 1 MiB: 4 of them cost 3 ms + 3 x 2 ms (overlapped: less than alone).
    alone = {1 << 12: 1e-3, 1 << 20: 3e-3}
    trains = {1 << 12: (32, 1e-3 + 31 * 1.5e-3), 1 << 20: (4, 3e-3 + 3 * 2e-3)}
    model = CostModel.fit([("all_reduce", n, t) for n, t in alone.items() for _ in range(3)],
                          trains=[("all_reduce", n, k, t) for n, (k, t) in trains.items() for _ in range(3)],
                          world_size=3)
    assert model.gap("all_reduce", 1 << 12) == pytest.approx(1.5e-3)  # above its isolated 1 ms: kept
    assert model.gap("all_reduce", 1 << 20) == pytest.approx(2e-3)
    # the train as stream_ends runs it: the first costs its time, the rest a gap each
    ends = stream_ends([(0.0, model.seconds("all_reduce", 4096), model.gap("all_reduce", 4096))] * 32)
    assert ends[-1] == pytest.approx(trains[1 << 12][1])
    # noise that puts a train below half its mean per collective is held there
    low = CostModel.fit([("all_reduce", n, t) for n, t in alone.items()],
                        trains=[("all_reduce", 1 << 12, 8, 1e-3 + 7 * 1e-5), ("all_reduce", 1 << 20, 2, 4e-3)],
                        world_size=2)
    assert low.gap("all_reduce", 1 << 12) == pytest.approx((1e-3 + 7e-5) / 8 / 2)


def test_a_big_collective_behind_a_small_one_costs_what_the_mixed_trains_measured():
    # Alone: 4 KiB 1 ms, 1 MiB 4 ms, 16 MiB 16 ms. Same-size trains overlap half of each big one
    # (gap 2 and 8 ms); behind a 4 KiB one (gap 1 ms) a big one adds 3 and 14 ms: the 3-rank gloo
    # train of docs/core.md in kind (gaps 12.5 ms, measured 15.7, alone 16.1).
    alone = {1 << 12: 1e-3, 1 << 20: 4e-3, 1 << 24: 16e-3}
    gap = {1 << 12: 1e-3, 1 << 20: 2e-3, 1 << 24: 8e-3}
    after_small = {1 << 20: 3e-3, 1 << 24: 14e-3}
    model = CostModel.fit([("all_reduce", n, t) for n, t in alone.items()],
                          trains=[("all_reduce", n, 4, t + 3 * gap[n]) for n, t in alone.items()],
                          mixed=[("all_reduce", n, 4, alone[n] + 3 * (a + gap[1 << 12]))
                                 for n, a in after_small.items()],
                          world_size=3)
    assert model.gap_after_small("all_reduce", 1 << 24) == pytest.approx(14e-3)
    assert model.gap_after_small("all_reduce", 1 << 12) == pytest.approx(1e-3)  # no mixed train: its gap
    # between measured sizes, interpolated, and never below the gap
    assert model.gap("all_reduce", 8 << 20) < model.gap_after_small("all_reduce", 8 << 20) < model.seconds(
        "all_reduce", 8 << 20)

    def task(n):
        return (0.0, model.seconds("all_reduce", n), *model.train_gaps("all_reduce", n))

    big, tiny = 1 << 24, 1 << 12
    assert model.train_gaps("all_reduce", big) == pytest.approx((8e-3, 14e-3, 1e-3))
    assert stream_ends([task(big)] * 4)[-1] == pytest.approx(16e-3 + 3 * 8e-3)  # same size: the gaps
    # the mixed trains it was fitted on come back
    assert stream_ends([task(big), task(tiny)] * 3 + [task(big)])[-1] == pytest.approx(16e-3 + 3 * (1e-3 + 14e-3))
    assert stream_ends([task(1 << 20), task(tiny)] * 3 + [task(1 << 20)])[-1] == pytest.approx(4e-3 + 3 * (1e-3 + 3e-3))
    # behind a 1 MiB one (4 ms: 3 ms more than the small one), 3 ms more of it hidden than behind a small one
    assert stream_ends([task(big), task(1 << 20), task(big)])[-1] == pytest.approx(16e-3 + 2e-3 + 14e-3 - 3e-3)
    # behind one as long as the gap's overlap (6 ms beyond the small one's), the same-size gap
    assert stream_ends([task(big), (0.0, 7e-3, 7e-3), task(big)])[-1] == pytest.approx(16e-3 + 7e-3 + 8e-3)
    # a gap after a small one without the small one's time is refused, not read as a 0 s predecessor
    with pytest.raises(ValueError, match="both or neither"):
        stream_ends([task(big), (0.0, 16e-3, 8e-3, 14e-3)])
    # the JSON keeps them; a model saved before mixed trains existed reads back without them
    assert CostModel.from_json(model.to_json()) == model
    old = model.to_json()
    for fit in old["fits"].values():
        del fit["after_small"]
    assert CostModel.from_json(old).gap_after_small("all_reduce", big) == pytest.approx(8e-3)


def test_mixed_trains_need_their_sizes_and_same_size_trains():
    samples = [("all_reduce", n, 1e-3) for n in (1 << 12, 1 << 20)]
    trains = [("all_reduce", n, 4, 4e-3) for n in (1 << 12, 1 << 20)]
    with pytest.raises(ValueError, match="not measured alone"):
        CostModel.fit(samples, trains=trains, mixed=[("all_reduce", 1 << 22, 4, 1e-2)], world_size=2)
    with pytest.raises(ValueError, match="same-size trains too"):
        CostModel.fit(samples, mixed=[("all_reduce", 1 << 20, 4, 1e-2)], world_size=2)
    with pytest.raises(ValueError, match="at least 2"):
        CostModel.fit(samples, trains=trains, mixed=[("all_reduce", 1 << 20, 1, 1e-2)], world_size=2)
