"""verify: SQNR per format on the fixtures, bit-exactness, JSON schema, thresholds, the plot."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import oracle
from inkling_ckpt.cli.app import main
from inkling_ckpt.errors import CheckpointError
from inkling_ckpt.layouts.sharded import shard
from inkling_ckpt.verify.compare import SCHEMA, build_report, compare, plot_report, tensor_stats

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(scope="module")
def mixed_vs_bf16():
    return build_report(compare(FIXTURES / "tiny-bf16", FIXTURES / "tiny-mixed", progress=False))


def test_tensor_stats_definitions():
    a = torch.tensor([1.0, -2.0, 0.0, 4.0])
    b = torch.tensor([1.0, -2.5, -0.0, 4.0])
    s = tensor_stats(a, b)
    assert (s.elements, s.exact_elements, s.bit_exact_tensors) == (4, 2, 0)  # -0.0 is not +0.0 bit for bit
    assert s.max_abs == 0.5
    assert s.sqnr_db == pytest.approx(10 * math.log10(21 / 0.25))
    assert s.rel_rmse == pytest.approx(math.sqrt(0.25 / 21))
    same = tensor_stats(a, a.clone())
    assert same.bit_exact_tensors == 1 and same.sqnr_db == math.inf and same.rel_rmse == 0.0
    nan = tensor_stats(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    assert nan.bit_exact_tensors == 1


def test_mixed_vs_bf16_sqnr_per_format(mixed_vs_bf16):
    f = mixed_vs_bf16["formats"]
    assert set(f) == {"dense", "nvfp4", "mxfp8"}
    assert 19.5 < f["nvfp4"]["sqnr_db"] < 21.5  # ~20 dB on Gaussian-like weights
    assert 30.5 < f["mxfp8"]["sqnr_db"] < 32.5  # ~31 dB
    assert f["dense"]["bit_exact_tensors"] == f["dense"]["tensors"] and f["dense"]["sqnr_db"] is None
    assert [(r["layer"], r["format"]) for r in mixed_vs_bf16["layers"]] == [
        (0, "nvfp4"), (1, "nvfp4"), (2, "mxfp8"), (3, "mxfp8")]
    assert all(r["tensors"] == 2 for r in mixed_vs_bf16["layers"])  # a layer's stacked w13 and w2
    sq = [t["sqnr_db"] for t in mixed_vs_bf16["tensors"] if t["sqnr_db"] is not None]
    assert sq == sorted(sq)  # worst first
    assert mixed_vs_bf16["tensors"][0]["format"] == "nvfp4"


def test_report_schema(mixed_vs_bf16):
    rep = mixed_vs_bf16
    assert rep["schema"] == SCHEMA
    assert set(rep) == {"schema", "a", "b", "summary", "formats", "layers", "tensors", "thresholds", "not_compared",
                        "rounding", "seconds", "bytes_read", "ranks"}
    assert rep["ranks"]["count"] == 1 and rep["ranks"]["each"][0]["units"] > 1
    both = sum(p.stat().st_size for v in ("tiny-bf16", "tiny-mixed") for p in (FIXTURES / v).glob("*.safetensors"))
    assert 0.9 * both < rep["bytes_read"] <= both  # both sides read once (less their headers)
    assert rep["not_compared"] == {"only_a": [], "only_b": []}
    assert set(rep["a"]) == {"source", "layout", "variant", "precision_plan"}
    stats = {"tensors", "bit_exact_tensors", "rounding_tensors", "elements", "exact_elements", "max_abs", "rel_rmse",
             "sqnr_db"}
    assert all(set(v) == stats for v in rep["formats"].values())
    assert all(set(r) == stats | {"layer", "format"} for r in rep["layers"])
    assert all(set(t) == stats | {"name", "format", "layer", "verdict", "rounding"} for t in rep["tensors"])
    assert set(rep["summary"]) == {"tensors", "bit_exact_tensors", "rounding_tensors", "mismatch_tensors", "elements",
                                   "exact_elements", "exact_fraction", "min_sqnr_db", "max_abs"}
    json.dumps(rep, allow_nan=False)  # strict JSON: no Infinity/NaN


def test_identical_and_resharded_are_bit_exact(tmp_path):
    rep = build_report(compare(FIXTURES / "tiny-mixed", FIXTURES / "tiny-mixed", progress=False), exact=True)
    assert rep["summary"]["exact_fraction"] == 1.0 and rep["thresholds"]["passed"]
    shard(FIXTURES / "tiny-mixed", tmp_path / "sh", 4, 4, progress=False)
    rep = build_report(compare(FIXTURES / "tiny-mixed", tmp_path / "sh", progress=False), exact=True)
    assert rep["summary"]["bit_exact_tensors"] == rep["summary"]["tensors"] and rep["thresholds"]["passed"]


def test_format_labels_between_quantized_variants():
    rep = build_report(compare(FIXTURES / "tiny-mixed", FIXTURES / "tiny-mxfp8", progress=False))
    assert set(rep["formats"]) == {"dense", "nvfp4->mxfp8", "mxfp8"}
    assert rep["formats"]["mxfp8"]["bit_exact_tensors"] == rep["formats"]["mxfp8"]["tensors"]


def _cli(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("args,code", [
    (["--min-sqnr", "15"], 0), (["--min-sqnr", "25"], 1), (["--exact"], 1), ([], 0),
])
def test_cli_exit_status_follows_thresholds(args, code, capsys):
    got, out, _ = _cli(["verify", str(FIXTURES / "tiny-bf16"), str(FIXTURES / "tiny-mixed"), "-q", *args], capsys)
    assert got == code
    if code:
        assert "FAILED" in out


def test_cli_json(capsys):
    code, out, _ = _cli(["verify", str(FIXTURES / "tiny-mxfp8"), str(FIXTURES / "tiny-mxfp8"), "-q", "--json",
                         "--exact"], capsys)
    rep = json.loads(out)
    assert code == 0 and rep["summary"]["exact_fraction"] == 1.0


def test_cli_bad_input(tmp_path, capsys):
    code, _, err = _cli(["verify", str(FIXTURES / "tiny-bf16"), str(tmp_path / "nope"), "-q"], capsys)
    assert code == 2 and err.count("\n") == 1 and "nope" in err
    other = tmp_path / "other"
    shutil.copytree(FIXTURES / "tiny-bf16", other)
    cfg = json.loads((FIXTURES / "tiny-bf16" / "config.json").read_text())
    cfg["text_config"]["num_experts_per_tok"] = 4  # same tensors, another model
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="configs differ in num_experts_per_tok"):
        compare(FIXTURES / "tiny-bf16", other, progress=False)


def test_plot_one_line_per_format(mixed_vs_bf16, tmp_path, capsys):
    oracle("matplotlib", "matplotlib")
    import matplotlib.image

    png = tmp_path / "sqnr.png"
    assert plot_report(mixed_vs_bf16, png) == 2
    img = matplotlib.image.imread(png)
    assert img.shape[0] > 100 and img.shape[1] > 100
    code, _, _ = _cli(["verify", str(FIXTURES / "tiny-bf16"), str(FIXTURES / "tiny-mixed"), "-q", "--plot",
                       str(tmp_path / "cli.png")], capsys)
    assert code == 0 and (tmp_path / "cli.png").stat().st_size > 1000


# ---- on the shared executor: the figures never depend on how the work was spread --------------------

def _run_free(rep: dict) -> dict:
    return {k: v for k, v in rep.items() if k not in ("seconds", "ranks")}


def _tree(values: list[float]) -> float:
    """The pairwise order _sum_sq promises, in plain Python floats."""
    while len(values) > 1:
        h = len(values) // 2
        values = [values[i] + values[h + i] for i in range(h)] + values[2 * h:]
    return values[0] if values else 0.0


def test_sum_of_squares_is_exact_per_square_in_a_fixed_order():
    from inkling_ckpt.verify.compare import _sum_sq

    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 1e3
    want = _tree([float(v) * float(v) for v in x.tolist()])  # float64 squares of float32 values are exact
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            assert _sum_sq(x) == want
    finally:
        torch.set_num_threads(threads)
    assert _sum_sq(torch.empty(0)) == 0.0 and _sum_sq(torch.tensor([3.0])) == 9.0
    assert math.isclose(want, math.fsum(float(v) ** 2 for v in x.tolist()), rel_tol=1e-13)


@pytest.mark.parametrize("pair", [("tiny-bf16", "tiny-mixed"), ("tiny-mixed", "tiny-mxfp8")])
def test_workers_and_slices_do_not_change_the_report(pair, monkeypatch):
    from inkling_ckpt.pipeline import Options
    from inkling_ckpt.verify import compare as cmp

    monkeypatch.setattr(cmp, "DECODE_ELEMENTS", 4096)  # several decode pieces per unit: more sums to order
    a, b = (FIXTURES / p for p in pair)
    small = 96 * 1024  # several units per stacked expert weight and per embedding
    one = build_report(compare(a, b, options=Options(device="cpu", slice_bytes=small, workers=1, progress=False)))
    many = build_report(compare(a, b, options=Options(device="cpu", slice_bytes=small, workers=3, progress=False)))
    assert one["ranks"]["each"][0]["units"] > 30 and many["ranks"]["each"][0]["workers"] == 3
    assert _run_free(many) == _run_free(one)
    # the same verdicts and (to rounding) the same figures as one piece per tensor
    whole = build_report(compare(a, b, progress=False))
    assert [(t["name"], t["verdict"], t["exact_elements"], t["max_abs"]) for t in whole["tensors"]] == \
        [(t["name"], t["verdict"], t["exact_elements"], t["max_abs"]) for t in one["tensors"]]
    for t, u in zip(whole["tensors"], one["tensors"], strict=True):
        assert (t["sqnr_db"] is None) == (u["sqnr_db"] is None)
        assert t["sqnr_db"] is None or math.isclose(t["sqnr_db"], u["sqnr_db"], rel_tol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_report_is_the_same_on_the_gpu():
    from inkling_ckpt.pipeline import Options

    for pair in (("tiny-bf16", "tiny-mixed"), ("tiny-mixed", "tiny-mxfp8"), ("tiny-bf16", "tiny-bf16")):
        a, b = (FIXTURES / p for p in pair)
        cpu = build_report(compare(a, b, options=Options(device="cpu", progress=False)))
        gpu = build_report(compare(a, b, options=Options(device="cuda", progress=False)))
        assert gpu["ranks"]["each"][0]["device"].startswith("cuda")
        assert _run_free(gpu) == _run_free(cpu), pair


def test_pieces_pool_in_plan_order_whatever_order_they_arrived_in():
    from dataclasses import astuple

    from inkling_ckpt.pipeline import Unit
    from inkling_ckpt.verify.compare import Stats, _fold

    # Σ over pieces in float64 is not associative: (1e16 + 1) - 1e16 == 0, (1e16 - 1e16) + 1 == 1.
    signal = [1e16, 1.0, -1e16]
    units = [Unit(f"u{i}") for i in range(3)]
    done = {f"u{i}": [("w", astuple(Stats(tensors=1, elements=1, signal=signal[i], noise=1.0)), None)]
            for i in (2, 0, 1)}  # as the ranks handed them back
    (item,) = _fold([("w", "nvfp4", 0)], units, done)
    assert item.stats.signal == (1e16 + 1.0) - 1e16 == 0.0
    assert item.stats.elements == 3 and item.stats.tensors == 1 and item.verdict == "mismatch"


def test_forward_mode_refuses_torchrun_and_tensor_only_options(capsys, monkeypatch):
    a = str(FIXTURES / "tiny-bf16")
    code, _, err = _cli(["verify", a, a, "--forward", "--workers", "2", "-q"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--workers does not apply with --forward" in err
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun starts each rank
    code, _, err = _cli(["verify", a, a, "--forward", "-q"], capsys)
    assert code == 2 and err.count("\n") == 1 and "without torchrun" in err


def test_text_report_says_how_it_ran(capsys):
    code, out, _ = _cli(["verify", str(FIXTURES / "tiny-bf16"), str(FIXTURES / "tiny-mixed"), "-q", "--device", "cpu",
                         "--workers", "2"], capsys)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("read "))
    assert " in " in line and "MB/s" in line and line.endswith("; cpu)") and "ranks" not in line


def test_decode_pieces_cover_the_slice_once():
    """verify's pieces (``convert.experts.expert_pieces``, shared with lora merge), at 14 elements;
    written as (first expert, last expert, first row, last row)."""
    from inkling_ckpt.convert.experts import expert_pieces

    def pieces(shape, experts, **kw):  # type: ignore[no-untyped-def]
        _, rows, cols = shape
        return [(js[0], js[-1] + 1, lo, hi) for js, lo, hi in expert_pieces(range(experts), rows, cols, 14, **kw)]

    assert pieces((8, 2, 3), 5) == [(0, 2, 0, 2), (2, 4, 0, 2), (4, 5, 0, 2)]  # whole experts
    assert pieces((8, 5, 7), 2) == [(0, 1, 0, 2), (0, 1, 2, 4), (0, 1, 4, 5),   # row blocks
                                    (1, 2, 0, 2), (1, 2, 2, 4), (1, 2, 4, 5)]
    assert pieces((8, 3, 20), 1) == [(0, 1, 0, 1), (0, 1, 1, 2), (0, 1, 2, 3)]  # at least a row
    # lora merge's: rows in pairs (w13's gate/up), at least one pair; experts need not be consecutive
    assert pieces((8, 6, 3), 1, row_multiple=2) == [(0, 1, 0, 4), (0, 1, 4, 6)]
    assert pieces((8, 6, 20), 1, row_multiple=2) == [(0, 1, 0, 2), (0, 1, 2, 4), (0, 1, 4, 6)]
    assert expert_pieces([0, 2, 3], 2, 3, 14) == [([0, 2], 0, 2), ([3], 0, 2)]


def _reference_stats(a: torch.Tensor, b: torch.Tensor, chunk: int) -> tuple:
    """tensor_stats' figures in plain Python floats: per chunk, the float32 error, float64 squares
    summed by the pairwise tree, pooled in chunk order; non-finite pairs left out of the sums."""
    exact, signal, noise, max_abs = 0, 0.0, 0.0, 0.0
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        exact += int((x.view(torch.int32) == y.view(torch.int32)).sum())
        e = (y - x).tolist()  # the error in float32, as the tool takes it
        pairs = [(u, d) for u, v, d in zip(x.tolist(), y.tolist(), e, strict=True) if math.isfinite(u) and math.isfinite(v)]
        signal += _tree([u * u for u, _ in pairs])
        noise += _tree([d * d for _, d in pairs])
        max_abs = max([max_abs] + [abs(d) for _, d in pairs])
        if len(pairs) < x.numel() and any(u != v and not (math.isnan(u) and math.isnan(v))
                                          for u, v in zip(x.tolist(), y.tolist(), strict=True)
                                          if not (math.isfinite(u) and math.isfinite(v))):
            max_abs = math.inf
    return exact, signal, noise, max_abs


def _stats_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (1, 64, 200, 1000):
        a = torch.randn(n, generator=g) * 10
        b = a + torch.randn(n, generator=g) * 1e-2
        out += [(a, b), (a, a.clone()), (a.bfloat16(), b.bfloat16())]
        if n > 100:
            c, d = a.clone(), b.clone()
            c[5], d[5] = math.nan, math.nan  # NaN on both sides: equal bits, out of the sums
            d[70] = math.inf  # a differing non-finite value: max error inf
            c[150] = d[150] = -math.inf
            out += [(c, d), (c, c.clone())]
            z = a.clone()
            z[:64] = -z[:64]  # one chunk wholly different, sign only
            out.append((a, z))
    return out


def test_tensor_stats_equal_a_plain_python_reference(monkeypatch):
    from inkling_ckpt.verify import compare as cmp

    monkeypatch.setattr(cmp, "STATS_CHUNK", 64)  # many chunks, full and partial rows
    for a, b in _stats_cases():
        s = cmp.tensor_stats(a, b)
        want = _reference_stats(a, b, 64)
        assert (s.exact_elements, s.signal, s.noise, s.max_abs) == want, (a.numel(), a.dtype)
        assert s.elements == a.numel() and s.bit_exact_tensors == int(want[0] == a.numel())
        e = cmp.exact_stats(a)
        assert (e.exact_elements, e.signal, e.noise, e.max_abs) == (a.numel(), *_reference_stats(a, a, 64)[1:3], 0.0)


@pytest.mark.parametrize("n", [1, 2, 3, 96, 4608 * 7, 3 * 2 ** 18, 2 ** 20 - 1, 12345 * 8, 2 ** 20])
def test_column_blocks_sum_in_the_whole_rows_tree(n):
    """The CPU's row figures (the tree's top levels a column block at a time) equal the pairwise
    tree run over the whole row, to the bit: counts of rows that divide by 32, by fewer powers of
    two, odd ones. Magnitudes over ~20 binades, so another order of the adds rounds otherwise."""
    import numpy as np

    from inkling_ckpt.verify import compare as cmp

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 7)).numpy().reshape(1, -1)
    y = (torch.from_numpy(x) * (1 + torch.randn(n, generator=g) * 1e-3)).numpy()
    y[0, : n // 3] = x[0, : n // 3]  # a third bit-equal
    sq_x = np.square(x, dtype=np.float64)
    e = y - x
    whole = (int(np.count_nonzero(x.view(np.int32) == y.view(np.int32))),
             float(cmp._pairwise(sq_x.copy(), cmp._np_add)[0]),
             float(cmp._pairwise(np.square(e, dtype=np.float64), cmp._np_add)[0]),
             float(np.abs(e).max()))
    assert cmp._np_row(x, y) == whole
    assert cmp._np_row(x, None) == (n, whole[1], 0.0, 0.0)
    if n >= 4608 * 7:  # the test tells orders apart: a plain left-to-right sum rounds otherwise
        assert float(np.cumsum(sq_x[0])[-1]) != whole[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensor_stats_same_bits_on_the_gpu(monkeypatch):
    from dataclasses import astuple

    from inkling_ckpt.verify import compare as cmp

    for chunk in (64, cmp.STATS_CHUNK):
        monkeypatch.setattr(cmp, "STATS_CHUNK", chunk)
        big = torch.randn(3 * (1 << 20) + 5, generator=torch.Generator().manual_seed(4))
        for a, b in _stats_cases() + [(big, big * (1 + 1e-3)), (big, big.clone())]:
            cpu, gpu = cmp.tensor_stats(a, b), cmp.tensor_stats(a.cuda(), b.cuda())
            assert str(astuple(cpu)) == str(astuple(gpu)), (chunk, a.numel())
            assert str(astuple(cmp.exact_stats(a))) == str(astuple(cmp.exact_stats(a.cuda())))


def test_verify_takes_the_cpu_default_of_workers_on_a_gpu_too(monkeypatch):
    """verify reads two slices per unit and copies its figures to the host even on a GPU: it asks
    the executor for at most the CPU's default workers there (4 ran it 1.7x faster than 8 on an H200)."""
    from conftest import executor_gpu_workers
    from inkling_ckpt.pipeline import executor as executor_mod
    from inkling_ckpt.verify import compare as cmp

    seen = executor_gpu_workers(monkeypatch, cmp)
    compare(FIXTURES / "tiny-bf16", FIXTURES / "tiny-mixed", progress=False)
    assert seen == [executor_mod.MAX_DEFAULT_WORKERS] and executor_mod.MAX_DEFAULT_WORKERS < executor_mod.MAX_DEFAULT_GPU_WORKERS


def test_reading_a_piece_at_a_time_gives_the_same_report(monkeypatch):
    """Where both sides read rows inside an expert (HF folders) each decode piece reads only its own
    bytes; the report is the one the whole-slice reads give, the pieces cut by rows included."""
    from inkling_ckpt.convert import experts as ex_mod
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.verify import compare as cmp

    ck = HFCheckpoint.open(FIXTURES / "tiny-mixed")
    for name in (n for n in ck.tensors if n.endswith("experts.w13_weight") or n.endswith("w13_weight_scale")):
        whole = ck.read_rows(name, 1, 2)
        assert torch.equal(ck.read_expert_rows(name, 1, 3, 7).view(torch.uint8), whole[:, 3:7].view(torch.uint8))
    monkeypatch.setattr(cmp, "DECODE_ELEMENTS", 4096)  # the tiny experts go by blocks of rows
    reads: list[tuple[int, int]] = []
    real = HFCheckpoint.read_expert_rows

    def spy(self, name, expert, start, stop, **kw):  # type: ignore[no-untyped-def]
        reads.append((start, stop))
        return real(self, name, expert, start, stop, **kw)

    monkeypatch.setattr(HFCheckpoint, "read_expert_rows", spy)
    for pair in (("tiny-bf16", "tiny-mixed"), ("tiny-mixed", "tiny-mxfp8"), ("tiny-mixed", "tiny-mixed")):
        a, b = (FIXTURES / p for p in pair)
        reads.clear()
        pieces = _run_free(build_report(compare(a, b, progress=False)))
        assert reads and any(lo > 0 for lo, _ in reads), pair  # rows inside experts were read
        with monkeypatch.context() as m:
            m.setattr(cmp, "reads_pieces", lambda src: False)
            whole = _run_free(build_report(compare(a, b, progress=False)))
        assert pieces == whole, pair
    assert ex_mod.reads_pieces(ck) and not ex_mod.reads_pieces(object())


def test_a_unit_is_charged_its_largest_piece_where_pieces_are_read(monkeypatch):
    """Reading a piece at a time, an expert unit holds its largest piece's share of what it reads (plus
    the comparison's workspace on the CPU), not the whole slice; other layouts are charged the slice."""
    from inkling_ckpt.pipeline import expert_slice
    from inkling_ckpt.verify import compare as cmp

    monkeypatch.setattr(cmp, "DECODE_ELEMENTS", 4096)  # the tiny experts go by blocks of rows
    a, b = cmp.open_pair(FIXTURES / "tiny-bf16", FIXTURES / "tiny-mixed")
    pieces = cmp.plan_units(a, b, 1 << 20)
    with monkeypatch.context() as m:
        m.setattr(cmp, "reads_pieces", lambda src: False)
        whole = cmp.plan_units(a, b, 1 << 20)
    assert [u.key for u in pieces] == [u.key for u in whole]
    experts = 0
    for p, w in zip(pieces, whole, strict=True):
        assert w.hold_bytes == w.read_bytes + cmp.COMPARE_WORKSPACE_BYTES
        if expert_slice(p) is None:
            assert p.hold_bytes == w.hold_bytes
            continue
        experts += 1
        st, first, last = expert_slice(p)
        _, rows, cols = st.shape
        share = -(-p.read_bytes * (4096 // cols) // ((last - first) * rows))  # one block of 4096 // cols rows
        assert p.hold_bytes == share + cmp.COMPARE_WORKSPACE_BYTES < w.hold_bytes
    assert experts


@pytest.mark.parametrize("slice_bytes", [1, 1 << 20])
def test_verify_units_name_the_bytes_they_read(file_reads, slice_bytes):
    """What the executor reads ahead for a verify unit (its extents) is what the unit then reads of
    both checkpoints, every byte and no other."""
    from conftest import byte_ranges
    from inkling_ckpt.pipeline import Executor, Options
    from inkling_ckpt.verify.compare import open_pair, plan_units, reads, transform

    a, b = open_pair(FIXTURES / "tiny-bf16", FIXTURES / "tiny-mixed")
    ex = Executor(Options(device="cpu", progress=False))
    run, extents = transform(a, b, ex), reads(a, b)
    units = plan_units(a, b, slice_bytes)
    for u in units:
        file_reads.clear()
        run(u)
        assert byte_ranges(file_reads) == byte_ranges(extents(u)), u.key
    assert len(units) > 10
