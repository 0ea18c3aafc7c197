import math

import numpy as np
import pytest
import torch

from layerwatch import stats as S


def finite_values(t: torch.Tensor) -> np.ndarray:
    a = t.detach().float().numpy().ravel()
    return a[np.isfinite(a)]


def off_edges(t: torch.Tensor, bins: int) -> torch.Tensor:
    """Nudge values sitting within float rounding of a bucket edge, so NumPy and we agree exactly."""
    row = S.reduce([t], bins, fast=False)[0].numpy()
    edges = row[S.ANCHOR] + (np.arange(0, bins + 1) - row[S.ZERO_POINT] + 0.5) * row[S.SCALE]
    a = t.numpy().copy()
    near = np.abs(a[..., None] - edges).min(-1) < 1e-6 * max(1.0, np.abs(a).max())
    a[near] += 1e-5 * row[S.SCALE]
    return torch.from_numpy(a)


def zoo() -> list[torch.Tensor]:
    torch.manual_seed(0)
    bad = torch.randn(200)
    bad[[3, 50]] = math.nan
    bad[7] = math.inf
    bad[9] = -math.inf
    return [
        torch.randn(64, 32) * 0.02,  # spans zero
        torch.rand(300) + 0.5,  # all positive: grid anchored at the minimum
        -torch.rand(40) - 2.0,  # all negative
        torch.zeros(7),  # constant zero
        torch.full((5,), 3.0),  # constant
        bad,  # NaN and Inf among finite values
        torch.tensor([1e-30, -1e-30, 0.0]),  # tiny range
    ]


@pytest.mark.parametrize("fast", [True, False], ids=["cpu-fast", "generic"])
def test_stats_match_numpy_and_read_nan_for_a_tensor_holding_nan_or_inf(fast):
    tensors = zoo()
    rows = S.reduce(tensors, 64, zeros=True, centered=True, fast=fast).numpy()
    got = S.scalar_stats(rows, S.STATS)
    for i, t in enumerate(tensors):
        f = finite_values(t)
        assert got["nonfinite"][i] == t.numel() - f.size
        actual = [got[k][i] for k in ("mean", "std", "min", "max", "norm", "zero_frac")]
        if f.size < t.numel():  # never a finite number that looks healthy (or dead)
            assert np.isnan(actual).all(), f"tensor {i}: {actual}"
            row = rows[i]  # the row itself stays exact over the finite values (histograms use it)
            if f.size:
                np.testing.assert_allclose([row[S.MIN], row[S.MAX], row[S.SUM]], [f.min(), f.max(), f.sum()], rtol=1e-5, atol=1e-6)
            continue
        expected = [f.mean(), f.std(), f.min(), f.max(), np.linalg.norm(f), (f == 0).sum() / t.numel()]
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7, err_msg=f"tensor {i}")


@pytest.mark.parametrize("fast", [True, False], ids=["cpu-fast", "generic"])
@pytest.mark.parametrize("bins", [2, 16, 64, 254])
def test_histogram_counts_match_numpy(fast, bins):
    for i, t in enumerate(zoo()):
        t = off_edges(t, bins) if torch.isfinite(t).all() else t
        hist = S.histogram(S.reduce([t], bins, fast=fast)[0].numpy(), bins)
        f = finite_values(t)
        assert hist.num == f.size and sum(hist.bucket_counts) == f.size
        assert hist.min == pytest.approx(f.min()) and hist.max == pytest.approx(f.max())
        assert len(hist.bucket_counts) <= bins
        assert list(hist.bucket_limits) == sorted(hist.bucket_limits) and hist.bucket_limits[-1] == hist.max
        edges = np.array([hist.min, *hist.bucket_limits])
        if f.min() != f.max():
            expected, _ = np.histogram(f, edges)
            np.testing.assert_array_equal(hist.bucket_counts, expected, err_msg=f"tensor {i}, bins {bins}")
        assert hist.bucket_counts[0] > 0 and hist.bucket_counts[-1] > 0  # trimmed to the support


@pytest.mark.parametrize("fast", [True, False], ids=["cpu-fast", "generic"])
def test_subnormal_values_a_vanished_gradient_holds_are_counted_in_one_bucket_or_two(fast):
    """A range narrower than float32's smallest normal (here 1e-44) once made buckets of width
    zero, and the batch raised (bincount of a NaN index): every tensor of it went unmeasured."""
    tiny = torch.finfo(torch.float32).tiny
    vanished = torch.tensor([0.0, 1.1210387714598537e-44, 2.2420775429197073e-44] * 6)
    tensors = [torch.zeros(16), vanished, torch.randn(100)]
    rows = S.reduce(tensors, 32, fast=fast).numpy()
    hist = S.histogram(rows[1], 32)
    assert hist.num == vanished.numel() == sum(hist.bucket_counts) and len(hist.bucket_counts) <= 2
    assert rows[1][S.SCALE] == pytest.approx(tiny) and rows[1][S.MAX] == pytest.approx(2.24e-44, rel=0.01)
    assert sum(S.histogram(rows[2], 32).bucket_counts) == 100  # its neighbours in the batch are measured


def test_fast_and_generic_paths_agree():
    # Values exactly on a bucket edge may round either way (ties); nudge them off first.
    tensors = [off_edges(t, 64) if torch.isfinite(t).all() else t for t in zoo() + [torch.randn(1000, 100)]]
    fast = S.reduce(tensors, 64, zeros=True, centered=True, fast=True)
    generic = S.reduce(tensors, 64, zeros=True, centered=True, fast=False)
    np.testing.assert_array_equal(fast[:, S.HIST :].numpy(), generic[:, S.HIST :].numpy())
    np.testing.assert_allclose(fast[:, : S.HIST].numpy(), generic[:, : S.HIST].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fast", [True, False], ids=["cpu-fast", "generic"])
def test_a_sampled_histogram_keeps_exact_stats_and_estimates_the_shape(fast):
    torch.manual_seed(0)
    t = torch.cat([torch.randn(199_990), torch.tensor([40.0] * 5 + [-9.0] * 5)])[torch.randperm(200_000)]
    exact = S.reduce([t], 64, zeros=True, centered=True, fast=fast)[0].numpy()
    sampled = S.reduce([t], 64, zeros=True, centered=True, fast=fast, histogram_values=10_000)[0].numpy()
    # stats and grid: untouched by the sample (up to the order of float summation)
    np.testing.assert_allclose(sampled[: S.HIST], exact[: S.HIST], rtol=1e-6)
    hist, reference = S.histogram(sampled, 64), S.histogram(exact, 64)
    assert hist.num == 200_000 and sum(hist.bucket_counts) == pytest.approx(200_000)
    assert (hist.min, hist.max) == (-9.0, 40.0)
    assert hist.bucket_counts[0] > 0 and hist.bucket_counts[-1] > 0  # the exact extremes are in the sample
    estimate = np.array(hist.bucket_counts) / 200_000
    truth = np.array(reference.bucket_counts) / 200_000
    assert 0.5 * np.abs(estimate - truth).sum() < 0.03  # total variation distance


@pytest.mark.parametrize("fast", [True, False], ids=["cpu-fast", "generic"])
def test_a_sampled_histogram_sees_every_channel_of_a_channels_last_layout(fast):
    channels = 64  # a power-of-two stride would see only some of them
    t = torch.arange(channels, dtype=torch.float32).repeat(8 * 16 * 16)
    hist = S.histogram(S.reduce([t], channels, fast=fast, histogram_values=4096)[0].numpy(), channels)
    counts = np.array(hist.bucket_counts)
    assert len(counts) == channels
    np.testing.assert_allclose(counts, t.numel() / channels, rtol=0.1)


def test_a_sampled_histogram_scales_to_the_finite_count():
    t = torch.randn(50_000)
    t[::7] = math.nan
    row = S.reduce([t], 32, histogram_values=1000)[0].numpy()
    finite = int(torch.isfinite(t).sum())
    assert row[S.COUNT] == finite and row[S.NONFINITE] == t.numel() - finite
    assert sum(S.histogram(row, 32).bucket_counts) == pytest.approx(finite)


def test_a_tensor_within_the_sample_size_is_read_whole():
    t = torch.randn(5000)
    np.testing.assert_array_equal(S.reduce([t], 64, histogram_values=5000), S.reduce([t], 64))


def test_all_nonfinite_tensor_has_no_histogram():
    row = S.reduce([torch.full((4,), math.nan)], 64)[0].numpy()
    assert row[S.COUNT] == 0 and row[S.NONFINITE] == 4
    assert S.histogram(row, 64) is None


def test_other_dtypes_are_measured_in_float32():
    t = torch.randn(100, dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        row = S.reduce([t.to(dtype)], 16)[0].numpy()
        assert row[S.COUNT] == 100
        assert row[S.SUM] == pytest.approx(t.to(dtype).double().sum().item(), abs=1e-3)


def test_no_histogram_when_bins_is_zero():
    rows = S.reduce([torch.randn(10)], 0)
    assert rows.shape == (1, S.HIST)


def test_reduce_does_not_change_inputs_or_grad_mode():
    p = torch.nn.Parameter(torch.randn(50, 50))
    before = p.detach().clone()
    rows = S.reduce([p], 64)
    assert torch.equal(p.detach(), before)
    assert not rows.requires_grad and torch.is_grad_enabled()


def test_bins_out_of_range_is_refused():
    with pytest.raises(ValueError, match="got 255"):
        S.reduce([torch.randn(3)], 255)


def test_a_histogram_sample_size_below_one_is_refused():
    with pytest.raises(ValueError, match="got 0"):
        S.reduce([torch.randn(3)], 16, histogram_values=0)


def test_to_host_keeps_order_and_shapes():
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([7.0])
    out = S.to_host([a.double(), b.double()])
    np.testing.assert_array_equal(out[0], [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(out[1], [7])


@pytest.mark.parametrize("chunk", [1 << 20, 3000], ids=["one-chunk", "many-chunks"])
def test_the_batched_path_matches_one_tensor_at_a_time(monkeypatch, chunk):
    """Sizes around the row width (256), a NaN among finite tensors, tensors whose histograms are
    sampled (above ``histogram_values``) beside exact ones, and chunks cut between tensors."""
    monkeypatch.setattr(S.batched, "chunk_values", lambda device: chunk)
    torch.manual_seed(1)
    tensors = [torch.randn(n) * scale + shift for n, scale, shift in
               [(1, 1, 0), (255, 0.1, 3), (256, 2, 0), (257, 1, -5), (1000, 1e-3, 1), (5000, 1, 0), (4, 0.1, 0)]]
    tensors[4][17] = math.nan
    tensors.append(torch.rand(20_000) + 1.0)  # sampled: stride 3 at histogram_values=8000
    tensors.append(torch.zeros(300))
    batched = S.reduce(tensors, 32, zeros=True, centered=True, histogram_values=8000).numpy()
    for i, t in enumerate(tensors):
        alone = S.reduce([t], 32, zeros=True, centered=True, fast=False, histogram_values=8000)[0].numpy()
        np.testing.assert_allclose(batched[i, : S.HIST], alone[: S.HIST], rtol=2e-6, atol=1e-7, err_msg=f"tensor {i}")
        if t.numel() <= 8000:  # exact histograms: the same buckets
            hist, reference = S.histogram(batched[i], 32), S.histogram(alone, 32)
            assert (hist is None) == (reference is None)
            if hist is not None:
                np.testing.assert_allclose(hist.bucket_counts, reference.bucket_counts, atol=1, err_msg=f"tensor {i}")
    sampled = S.histogram(batched[-2], 32)
    assert sum(sampled.bucket_counts) == pytest.approx(20_000)
    assert (sampled.min, sampled.max) == (float(tensors[-2].min()), float(tensors[-2].max()))


def test_a_small_tensor_padded_to_a_row_keeps_its_digits():
    t = torch.tensor([-0.1297536, 0.001, -0.002, 0.0005])  # padded with 252 copies of its last value
    row = S.reduce([t], 16)[0].numpy()
    assert math.sqrt(row[S.SUMSQ]) == pytest.approx(t.double().norm().item(), rel=1e-7)
    assert row[S.SUM] == pytest.approx(t.double().sum().item(), rel=1e-6)


def test_an_empty_tensor_has_an_empty_row_and_leaves_its_neighbours_alone():
    torch.manual_seed(0)
    neighbour = torch.randn(600)
    for bins in (0, 32):
        rows = S.reduce([torch.empty(0), neighbour, torch.empty(0, 3)], bins).numpy()
        assert rows[0, S.COUNT] == 0 and rows[2, S.COUNT] == 0 and rows[0, S.NONFINITE] == 0
        assert rows[1, S.COUNT] == 600 and rows[1, S.SUM] == pytest.approx(neighbour.double().sum().item(), abs=1e-4)


def test_a_kept_workspace_gives_the_rows_of_a_fresh_one_call_after_call():
    """Plans and their views into the chunk buffer are kept by shapes: new values in the same
    shapes, a call on other shapes in between (which may grow the buffer) and mixed dtypes and
    layouts read exactly as a fresh workspace reads them."""
    torch.manual_seed(0)
    workspace = S.Workspace()
    shapes = [(300, 7), (5,), (64, 64), (3, 1000), (1,)]
    for k in range(3):
        tensors = [torch.randn(shape) * (k + 1) for shape in shapes]
        tensors[2] = tensors[2].t()  # not contiguous
        tensors[3] = tensors[3].to(torch.bfloat16)
        kept = S.reduce(tensors, 32, centered=True, histogram_values=500, workspace=workspace)
        fresh = S.reduce(tensors, 32, centered=True, histogram_values=500)
        np.testing.assert_array_equal(kept.numpy(), fresh.numpy())
        S.reduce([torch.randn(3_000_000)], 32, workspace=workspace)  # another plan in between
    for k in range(S.Workspace.PLANS + 4):
        S.reduce([torch.randn(k + 1)], 8, workspace=workspace)
    assert len(workspace._plans) == S.Workspace.PLANS


def test_the_parameter_families_make_no_python_call_per_tensor(benchmarks):
    """A sampled step's reductions of weights, gradients and updates run the same Python
    functions for 10 tensors as for 400 (once each plan is made): per-tensor work is in torch."""
    from tensor_count import python_calls

    assert python_calls(400, 64) == python_calls(10, 64)


@pytest.mark.parametrize("limit", [100, 3000, None])
def test_padding_to_a_wide_sample_stride_and_conjugate_views_read_as_the_reference(limit):
    """A small ``histogram_values`` makes rows wider than a chunk's budget; a conjugate view
    counts the values it shows."""
    torch.manual_seed(0)
    tensors = [torch.randn(500_000), torch.randn(7, 3), torch.randn(1000, dtype=torch.complex64).conj(), torch.randn(())]
    fast = S.reduce(tensors, 32, centered=True, histogram_values=limit)
    generic = S.reduce(tensors, 32, centered=True, fast=False, histogram_values=limit)
    np.testing.assert_allclose(fast[:, : S.HIST].numpy(), generic[:, : S.HIST].numpy(), rtol=1e-4, atol=1e-4)  # float32 sums
    assert fast[2, S.SUM].item() == pytest.approx(torch.view_as_real(tensors[2].resolve_conj()).sum().item(), rel=1e-4, abs=1e-3)


def test_a_padding_value_on_a_bucket_edge_is_taken_out_of_the_bucket_it_was_counted_in():
    """A small tensor is padded to a whole row with copies of its last value, counted and then
    taken back out of the bucket counts: both by the same float32 ops, or a last value on a
    bucket's edge (here -0.3) leaves one bucket at -251 and the next at 253."""
    t = torch.tensor([2.5, 0.8, 0.0, -1.7, -0.3])
    counts = np.asarray(S.histogram(S.reduce([t], 8)[0].numpy(), 8).bucket_counts)
    reference = np.asarray(S.histogram(S.reduce([t], 8, fast=False)[0].numpy(), 8).bucket_counts)
    assert counts.min() >= 0 and counts.sum() == 5
    np.testing.assert_allclose(counts, reference, atol=1)


def test_a_kept_workspace_serves_the_same_shapes_at_other_bucket_counts():
    """A plan holds each wave's bucket offsets, so plans are kept per bucket count."""
    torch.manual_seed(0)
    tensors, workspace = [torch.randn(1000), torch.randn(300)], S.Workspace()
    for bins in (8, 32, 8, 0):
        kept = S.reduce(tensors, bins, workspace=workspace)
        np.testing.assert_array_equal(kept.numpy(), S.reduce(tensors, bins).numpy())
        if bins:
            assert kept[:, S.HIST :].sum(1).tolist() == [1000, 300]


def test_reduce_measures_in_float32_whatever_the_default_dtype():
    torch.manual_seed(0)
    tensors = [torch.randn(1000), torch.randn(3, 700)]
    expected = S.reduce(tensors, 16).numpy()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        np.testing.assert_array_equal(S.reduce(tensors, 16).numpy(), expected)
        assert S.reduce([torch.empty(0), tensors[0]], 0).shape == (2, S.row_width(0))
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("bins", [0, 16])
def test_the_reference_rows_are_as_wide_as_the_batched_ones(bins):
    t = torch.randn(50)
    assert S.reduce([t], bins, fast=False).shape == S.reduce([t], bins).shape == (1, S.row_width(bins))


def test_a_last_row_is_taken_out_in_float64_near_float32s_limit_and_beside_an_outlier():
    """The padding's correction subtracts a tensor's last value from its last row: in float32
    that overflowed for values near 3.4e38 (SUM read inf) and lost digits to a large last value."""
    row = S.reduce([torch.tensor([3e38, -3e38])], 8)[0]
    assert row[S.SUM].item() == 0.0 and row[S.SUMSQ].item() == pytest.approx(2 * 3e38**2, rel=1e-6)
    torch.manual_seed(0)
    t = torch.cat([torch.rand(300), torch.tensor([1000.0])])
    row = S.reduce([t], 0)[0]
    assert row[S.SUMSQ].item() == pytest.approx((t.double() ** 2).sum().item(), rel=1e-8)  # was 9e-6 off
    assert row[S.SUM].item() == pytest.approx(t.double().sum().item(), rel=1e-6)  # a float32 row sum beside it
