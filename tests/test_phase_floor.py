"""kernels/phase_floor.py in the interpreter against its twin, and bench/floor.py's arithmetic and
refusals with a stub timer (the GPU timings themselves are not tests)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fastgemma.bench import floor
from fastgemma.kernels.phase_floor import (WORDS, PhaseError, ahead_warps, phase_chain, phase_persistent, phase_ref,
                                           ring_weights, stream_buffers, stream_ref)


def _x(hidden, seed=0):
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    x = torch.zeros(2, hidden)
    x[0] = v
    return x


@pytest.mark.parametrize("programs,hidden,n", [(1, 40, 3), (3, 40, 5), (7, 37, 4), (37, 37, 3), (5, 130, 6)])
@pytest.mark.parametrize("style", ["graph", "pdl", "pdl_ahead"])
def test_chain_equals_the_twin(programs, hidden, n, style):
    """Shares that do not divide the vector (37 values over 7 programs), a program per value, the
    last programs without a share (130 values: 5 programs of 26)."""
    x, w = _x(hidden), ring_weights(programs, hidden)
    want = phase_ref(x, w, n)
    phase_chain(x, w, n, style)
    assert torch.equal(x[n % 2], want)


def test_ring_weights_rotate_the_values():
    """Each phase moves a program's value to the program before it: after P phases the vector is
    back where it started (its shares' first values), and no two phases in between agree with it."""
    P, H = 4, 16
    x, w = _x(H), ring_weights(P, H)
    start = phase_ref(x, w, P)
    seen = [phase_ref(x, w, n) for n in range(1, P)]
    assert all(not torch.equal(s, start) for s in seen)
    assert torch.equal(phase_ref(x, w, 2 * P), start)
    assert len(set(start.tolist())) == P


@pytest.mark.parametrize("ahead", [False, True])
def test_persistent_equals_the_twin_and_resets_its_barrier(ahead):
    x, w = _x(48), ring_weights(1, 48)
    bar, err = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for n in (5, 2):  # a second launch starts from a reset barrier
        x[0] = _x(48, seed=n)[0]
        want = phase_ref(x, w, n)
        phase_persistent(x, w, n, bar, err, ahead=ahead)
        assert torch.equal(x[n % 2], want)
        assert bar.tolist() == [0, 0] and err.item() == 0


def test_boundary_only_touches_nothing():
    x = _x(32)
    before = x.clone()
    phase_chain(x, ring_weights(2, 32), 3, "pdl", work=False)
    phase_persistent(x, ring_weights(1, 32), 3, torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), work=False)
    assert torch.equal(x, before)


@pytest.mark.parametrize("x,w,n,msg", [
    (torch.zeros(3, 8), torch.zeros(1, 8), 1, "pair of fp32"),
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(1, 8), 1, "pair of fp32"),
    (torch.zeros(2, 8), torch.zeros(1, 9), 1, "w must be fp32"),
    (torch.zeros(2, 8), torch.zeros(9, 8), 1, "programs must be in"),
    (torch.zeros(2, 8), torch.zeros(2, 8), 0, "positive integer"),
    (torch.zeros(2, 8), torch.zeros(2, 8), True, "positive integer"),
])
def test_bad_inputs_are_refused(x, w, n, msg):
    with pytest.raises(PhaseError, match=msg):
        phase_chain(x, w, n)


def test_bad_style_is_refused():
    for style in ("barrier", "barrier_ahead"):
        with pytest.raises(PhaseError, match="style is one of graph, pdl, pdl_ahead"):
            phase_chain(_x(8), ring_weights(2, 8), 1, style)


def test_bench_slope_rows_and_table(tmp_path, monkeypatch):
    """A stub timer that charges 3 us per launch plus 10 us per phase of a chain, 2 us per barrier
    phase plus 5 per launch: the slope between n and 2n phases takes the fixed costs out. Barrier
    rows above one program are skipped on a CPU (the interpreter runs programs one at a time)."""
    launches = []
    real_chain, real_pers = floor.phase_chain, floor.phase_persistent

    def chain(x, w, n, style, work=True, stream=None):
        launches.append(("chain", n))
        real_chain(x, w, n, style, work=work, stream=stream)

    def pers(x, w, n, bar, err, work=True, stream=None, ahead=False):
        launches.append(("barrier", n))
        real_pers(x, w, n, bar, err, work=work, stream=stream, ahead=ahead)

    def timer(fn):
        launches.clear()
        fn()
        (kind, n), = launches
        return 3 + 10 * n if kind == "chain" else 5 + 2 * n

    monkeypatch.setattr(floor, "phase_chain", chain)
    monkeypatch.setattr(floor, "phase_persistent", pers)
    with open(tmp_path / "f.jsonl", "w") as f:
        rows = floor.bench_floor(programs=(1, 3), phases=4, hidden=24, works=(True, False), timer=timer,
                                 device="cpu", out=f)
    got = {(r["style"], r["work"], r["programs"]): r for r in rows}
    assert len(rows) == 12
    assert got[("graph", True, 3)]["us_per_phase"] == 10.0
    assert got[("pdl", False, 1)]["us_per_phase"] == 10.0
    assert got[("barrier", True, 1)]["us_per_phase"] == 2.0
    assert "resident" in got[("barrier", True, 3)]["skipped"]
    lines = [json.loads(s) for s in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert len(lines) == 10 and all("us_per_phase" in r for r in lines)
    t = floor.table(rows, step_launches=100)
    assert "| 0 | barrier | read + dot + write | 2.00 | - |" in t
    assert "| 0 | pdl | boundary only | 10.00 | 10.00 |" in t
    assert "barrier work 1: 200" in t


def test_a_stale_vector_is_caught(monkeypatch):
    """A chain that skips its last phase leaves another vector than the twin's: the bench says so."""
    real = floor.phase_chain
    monkeypatch.setattr(floor, "phase_chain",
                        lambda x, w, n, style, work=True, stream=None: real(x, w, n - 1, style, work=work, stream=stream))
    with pytest.raises(RuntimeError, match="differs from the twin"):
        floor.bench_floor(programs=(3,), styles=("graph",), phases=4, hidden=9, timer=lambda fn: 0.0, device="cpu")


def test_cli_refuses_bad_arguments(capsys):
    for argv, msg in ((["--programs", "0,2"], "program counts >= 1"), (["--mb", "4,x"], "comma-separated MB"),
                      (["--styles", "graph,warp"], "styles are"), (["--phases", "0"], "must be positive")):
        with pytest.raises(SystemExit):
            floor.main(argv)
        assert msg in capsys.readouterr().err


def _floor_file(tmp_path, lines):
    path = tmp_path / "floor.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def test_floor_figures_load_and_interpolate(tmp_path):
    """load_floor keeps one style's figures with work (a later line wins); floor_us is linear between
    the measured program counts and takes the nearest end outside them."""
    path = _floor_file(tmp_path, [
        dict(style="pdl", work=True, programs=16, us_per_phase=1.0),
        dict(style="pdl", work=True, programs=132, us_per_phase=2.0),
        dict(style="pdl", work=False, programs=80, us_per_phase=0.5),
        dict(style="graph", work=True, programs=80, us_per_phase=9.0),
        dict(style="barrier", work=True, programs=264, skipped="resident"),
        dict(style="pdl", work=True, programs=16, us_per_phase=1.2),
    ])
    pts = floor.load_floor(path)
    assert pts == [(16, 1.2), (132, 2.0)]
    assert floor.load_floor(path, "graph") == [(80, 9.0)]
    assert floor.floor_us(pts, 1) == 1.2 and floor.floor_us(pts, 640) == 2.0
    assert floor.floor_us(pts, 74) == pytest.approx(1.6)
    with pytest.raises(ValueError, match="no barrier figures"):
        floor.load_floor(path, "barrier")
    with pytest.raises(ValueError, match="style is one of"):
        floor.load_floor(path, "warp")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"style": "pdl"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        floor.load_floor(bad)


def test_timeline_with_the_floor(capsys):
    """Each group's boundaries: n x the figure of its grid's programs; the summary's: every kernel of
    the median call; the table gains the two columns."""
    from fastgemma.bench.timeline import charge, print_groups, summarize, with_floor

    call = [dict(name="g", grid=(64, 2, 1), start=0.0, dur=5.0), dict(name="s", grid=(1, 1, 1), start=5.0, dur=2.0),
            dict(name="g", grid=(64, 2, 1), start=7.0, dur=5.0)]
    s = summarize([charge(call), charge(call)])
    pts = [(1, 1.0), (256, 2.0)]
    f = with_floor(s, pts)
    g = {r["name"]: r for r in f["groups"]}
    assert g["g"]["boundary_us"] == pytest.approx(2 * (1.0 + 127 / 255))
    assert g["s"]["boundary_us"] == 1.0
    assert f["boundary_us"] == pytest.approx(2 * (1.0 + 127 / 255) + 1.0) and "boundary_us" not in s
    print_groups(f, "floor")
    out = capsys.readouterr().out
    assert f"boundaries {f['boundary_us']:.1f} us" in out and "| boundaries (floor) | above them |" in out
    assert f"| g | 64x2x1 | 2 | 10.0 | 10.0 | 0.0 | {g['g']['boundary_us']:.1f} | {10 - g['g']['boundary_us']:.1f} |" in out


def test_stack_floor_needs_the_timeline_and_a_floor_file(tmp_path):
    from fastgemma.bench import stack

    with pytest.raises(SystemExit, match="give --timeline N too"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--floor", str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit, match="--floor: .*none.jsonl"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--timeline", "3", "--floor", str(tmp_path / "none.jsonl")])
    empty = _floor_file(tmp_path, [dict(style="graph", work=True, programs=1, us_per_phase=1.0)])
    with pytest.raises(SystemExit, match="--floor: .*no pdl figures"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--timeline", "3", "--floor", str(empty)])


@pytest.mark.parametrize("style", ["graph", "pdl", "pdl_ahead"])
def test_streamed_chain_reads_each_phase_copy(style):
    """Phase i reads copy (first + i) % copies before its wait; the sink keeps the last phase's sums;
    the vector is the twin's as without streaming."""
    P, H, n = 3, 40, 5
    big, sink = stream_buffers(copies=3, programs=P, blocks=2)
    x, w = _x(H), ring_weights(P, H)
    want = phase_ref(x, w, n)
    phase_chain(x, w, n, style, stream=(big, sink), first=2)
    assert torch.equal(x[n % 2], want)
    assert torch.equal(sink, stream_ref(big, [(2 + n - 1) % 3]))
    assert not torch.equal(stream_ref(big, [0]), stream_ref(big, [1]))  # the copies tell phases apart


def test_streamed_persistent_reads_every_next_phase_before_its_barrier():
    big, sink = stream_buffers(copies=2, programs=1, blocks=3)
    x, w = _x(24), ring_weights(1, 24)
    bar, err = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    n = 4
    want = phase_ref(x, w, n)
    phase_persistent(x, w, n, bar, err, stream=(big, sink))
    assert torch.equal(x[n % 2], want) and bar.tolist() == [0, 0]
    assert torch.equal(sink, stream_ref(big, [i % 2 for i in range(n + 1)]))


def test_streamed_persistent_ahead_reads_each_phase_once():
    """barrier_ahead: phase i's words (copy i % copies) issued before the wait that opens phase i and
    summed after it: phases 0..n - 1, none beyond; the vector the twin's."""
    big, sink = stream_buffers(copies=3, programs=1, blocks=2)
    x, w = _x(24), ring_weights(1, 24)
    bar, err = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    n = 4
    want = phase_ref(x, w, n)
    phase_persistent(x, w, n, bar, err, stream=(big, sink), ahead=True)
    assert torch.equal(x[n % 2], want) and bar.tolist() == [0, 0] and err.item() == 0
    assert torch.equal(sink, stream_ref(big, [i % 3 for i in range(n)]))
    assert not torch.equal(sink, stream_ref(big, [i % 3 for i in range(n + 1)]))


def test_ahead_warps_hold_the_words_in_registers():
    """4 warps without the ahead styles; with them, enough warps for <= AHEAD_REGS words a thread,
    up to 16, and a refusal past AHEAD_MAX_BLOCKS blocks (the bench skips that row)."""
    assert ahead_warps(40, False) == 4
    assert [ahead_warps(b, True) for b in (1, 2, 3, 4, 5, 8, 9, 12)] == [4, 4, 8, 8, 16, 16, 16, 16]
    with pytest.raises(PhaseError, match="at most 12 blocks"):
        ahead_warps(13, True)
    rows = floor.bench_floor(programs=(1,), styles=("pdl", "pdl_ahead"), phases=2, hidden=16, mbs=(0.25,),
                             timer=lambda fn: (fn(), 1.0)[1], device="cpu")
    got = {r["style"]: r for r in rows}
    assert "us_per_phase" in got["pdl"] and "at most 12 blocks" in got["pdl_ahead"]["skipped"]


def test_stream_buffers_and_shapes_are_checked():
    big, sink = stream_buffers(2, 3, 1)
    assert big.shape == (2, 3, 1, WORDS) and big.dtype == torch.int32 and sink.tolist() == [0, 0, 0]
    with pytest.raises(PhaseError, match="must be >= 1"):
        stream_buffers(0, 3, 1)
    with pytest.raises(PhaseError, match=r"int32 \[copies, programs=2"):
        phase_chain(_x(8), ring_weights(2, 8), 1, stream=(big, sink))
    with pytest.raises(PhaseError, match=r"sink must be int32 \[3\]"):
        phase_chain(_x(8), ring_weights(3, 8), 1, stream=(big, torch.zeros(2, dtype=torch.int32)))
    assert floor.stream_shape(1.0, 16, 0) == (4, 2)  # 16 programs x 4 blocks x 16 KB = 1.05 MB
    blocks, copies = floor.stream_shape(4.0, 132, 60 * 2**20)
    assert blocks == 2 and copies == math.ceil(2 * 60 * 2**20 / (2 * 132 * WORDS * 4))
    with pytest.raises(ValueError, match="at most 64"):
        floor.stream_shape(64.0, 1, 0)


def test_bench_streamed_rows_carry_their_bytes(monkeypatch):
    """--mb: each row carries the MB its whole blocks make; the table shows them beside the figure
    and, given the copy bandwidth, the bytes alone; the floor file ignores streamed rows."""
    rows = floor.bench_floor(programs=(1, 2), styles=("pdl", "barrier"), phases=2, hidden=16, mbs=(0, 0.05, 4.3),
                             timer=lambda fn: (fn(), 1.0)[1], device="cpu")
    too_many = [r for r in rows if r["mb_asked"] == 4.3 and r["style"] == "pdl"]
    assert [r["programs"] for r in too_many] == [1, 2] and all("at most 64" in r["skipped"] for r in too_many)
    rows = [r for r in rows if r["mb_asked"] != 4.3]
    got = {(r["mb_asked"], r["style"], r["programs"]): r for r in rows}
    assert got[(0.05, "pdl", 2)]["mb"] == pytest.approx(2 * 2 * WORDS * 4 / 1e6)
    assert got[(0.05, "pdl", 1)]["mb"] == pytest.approx(3 * WORDS * 4 / 1e6)
    assert got[(0, "pdl", 1)]["mb"] == 0 and "skipped" in got[(0.05, "barrier", 2)]
    t = floor.table(rows, copy_gbs=100.0)
    assert "| 0.05 | pdl | read + dot + write | 0.00 (0.0492 MB) | 0.00 (0.0655 MB) |" in t
    assert f"| 0.05 | the bytes alone at 0.10 TB/s | | {1e3 * 3 * WORDS * 4 / 1e6 / 100:.2f} |" in t


def test_bench_checks_the_ahead_styles_streamed_sums(monkeypatch):
    """The bench runs the ahead styles' streamed chains (each checked against the twin's sums: the
    sink after n phases) and catches a persistent chain that sums the wrong copies."""
    rows = floor.bench_floor(programs=(1,), styles=("pdl_ahead", "barrier_ahead"), phases=3, hidden=16, mbs=(0.05,),
                             timer=lambda fn: (fn(), 1.0)[1], device="cpu")
    assert [(r["style"], r["us_per_phase"]) for r in rows] == [("pdl_ahead", 0.0), ("barrier_ahead", 0.0)]
    assert floor.copies_summed("barrier_ahead", 3, 2) == [0, 1, 0]
    assert floor.copies_summed("barrier", 3, 2) == [0, 1, 0, 1] and floor.copies_summed("pdl_ahead", 3, 2) == [0]
    real = floor.phase_persistent
    monkeypatch.setattr(floor, "phase_persistent", lambda *a, **k: real(*a, **dict(k, ahead=False)))
    with pytest.raises(RuntimeError, match="streamed words' sums differ"):
        floor.bench_floor(programs=(1,), styles=("barrier_ahead",), phases=3, hidden=16, mbs=(0.05,),
                          timer=lambda fn: 0.0, device="cpu")
