"""hybrid.bench._stats on series whose answers are known by hand."""

import pytest

from hybrid.bench._stats import NEIGHBOUR_REPS, Ratio, neighbour_reps, paired_ratio, ratio_range, ratio_table


def test_paired_ratio_is_the_median_of_per_repetition_ratios():
    # Drift that doubles both paths in repetition 2 cancels in the paired ratio, not in the medians'.
    a, b = [1.1, 2.2, 1.1], [1.0, 2.0, 1.0]
    assert paired_ratio(a, b) == pytest.approx(1.1, rel=1e-12)
    with pytest.raises(ValueError, match="equally long, non-empty series, got 2 and 3"):
        paired_ratio([1.0, 2.0], [1.0, 2.0, 3.0])


@pytest.mark.parametrize("ratios, expected", [
    ([1.0], (1.0, 1.0)),                        # one repetition: no spread to show
    ([0.9, 1.1], (0.95, 1.05)),                  # inclusive quartiles of two values
    ([1.1, 0.9, 1.0], (0.95, 1.05)),             # order does not matter
    ([1.0, 2.0, 3.0, 4.0, 5.0], (2.0, 4.0)),
    ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0], (1.0, 1.0)),  # one outlier does not set the range
])
def test_ratio_range_is_the_middle_half(ratios, expected):
    times = [2.0 * r for r in ratios]
    assert ratio_range(times, [2.0] * len(ratios)) == pytest.approx(expected, rel=1e-12)


def test_noise_interval_of_a_known_series():
    # The reference timed twice per repetition, the second time 10% slower, then 10% faster, alternately
    # (a load that comes and goes): the A/A median is 1 and its middle half spans the swing.
    first = [10.0] * 8
    second = [11.0, 9.0] * 4
    same = Ratio("torch'", "torch", second, first)
    assert same.cells() == ["1.000", "0.900-1.100", "1.000"]


def test_neighbour_reps_pairs_each_repetition_with_the_one_before():
    later, earlier = neighbour_reps([4.0, 2.0, 3.0, 6.0])
    assert (later, earlier) == ([2.0, 3.0, 6.0], [4.0, 2.0, 3.0])
    assert paired_ratio(later, earlier) == 1.5
    with pytest.raises(ValueError, match="at least two, got 1"):
        neighbour_reps([1.0])


def test_ratio_says_which_side_of_one_is_better():
    assert Ratio("hybrid", "torch", [1.0], [1.0]).reading() == "< 1: hybrid faster"
    assert Ratio("per_tensor", "hybrid", [1.0], [1.0], better=">").reading() == "> 1: hybrid faster"
    with pytest.raises(ValueError, match="better must be '<' or '>', got '<='"):
        Ratio("a", "b", [1.0], [1.0], better="<=")
    with pytest.raises(ValueError, match="got 1 and 2"):
        Ratio("a", "b", [1.0], [1.0, 2.0])


def test_ratio_table_rows_and_legend():
    ab = Ratio("hybrid", "torch", [9.0, 8.0, 10.0], [10.0, 10.0, 10.0])
    same = Ratio("torch'", "torch", [10.0, 10.5, 9.5], [10.0, 10.0, 10.0])
    lines = ratio_table({"mlp": ([ab], same), "tiny": ([ab], None)}, group="model").splitlines()
    assert lines[0].split() == ["model", "ratio", "of", "times", "paired", "middle", "half", "of", "medians", "better"]
    assert lines[2].split() == ["mlp", "hybrid/torch", "0.900", "0.850-0.950", "0.900", "<", "1:", "hybrid", "faster"]
    assert lines[3].split() == ["mlp", "A/A", "(noise)", "torch'/torch", "1.000", "0.975-1.025", "1.000", "1", "=",
                                "no", "noise"]
    assert lines[5].split() == ["tiny", "A/A", "(noise)", "n/a", "needs", "more", "repetitions"]
    legend = " ".join(line.strip() for line in lines[6:])
    assert "paired: the median over the repetitions of one path's time over the other's in the same repetition" in legend
    assert "the reference path timed twice in every repetition" in legend
    assert "An A/B ratio inside its group's A/A middle half cannot be told from noise." in legend
    neighbours = ratio_table({"save": ([ab], same)}, noise=NEIGHBOUR_REPS)
    assert "each repetition of the reference path over the repetition before it" in " ".join(neighbours.split())
