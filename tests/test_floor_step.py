"""kernels/phase_floor.phase_sequence in the interpreter against its twin, and bench/floor_step.py's
layout, arithmetic, checks and refusals with a stub timer (the GPU timings themselves are not tests)."""
from __future__ import annotations

import pytest
import torch

from fastgemma.bench import floor, floor_step
from fastgemma.kernels.phase_floor import (MIN_WORDS, WORDS, PhaseError, phase_sequence, ring_weights,
                                           sequence_ref, stream_buffers, stream_ref)


def _x(hidden, seed=0):
    x = torch.zeros(2, hidden)
    x[0] = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return x


@pytest.mark.parametrize("style", ["graph", "pdl", "pdl_ahead"])
def test_sequence_equals_the_twin_and_reads_each_layers_copy(style):
    """Three kinds of 3, 4 and 5 programs (one without words, two with blocks of two sizes) over 3
    layers: the vector is the twin's, and each kind's sink holds its last layer's copy."""
    H = 40
    kinds = [(ring_weights(3, H), stream_buffers(2, 3, 2, words=MIN_WORDS)), (ring_weights(4, H), None),
             (ring_weights(5, H), stream_buffers(3, 5, 1, seed=1, words=2 * MIN_WORDS))]
    x = _x(H)
    want = sequence_ref(x, [w for _ in range(3) for w, _ in kinds])
    phase_sequence(x, kinds, 3, style, first=1)
    assert torch.equal(x[9 % 2], want)
    assert torch.equal(kinds[0][1][1], stream_ref(kinds[0][1][0], [(1 + 2) % 2]))
    assert torch.equal(kinds[2][1][1], stream_ref(kinds[2][1][0], [(1 + 2) % 3]))
    # the check has teeth: a sequence one phase short (or in another order) leaves another vector
    assert not torch.equal(sequence_ref(x, [w for _ in range(3) for w, _ in kinds][:-1]), want)
    assert not torch.equal(sequence_ref(x, [w for _ in range(3) for w, _ in kinds[::-1]]), want)


def test_sequence_and_buffers_refuse_bad_input():
    x = _x(8)
    with pytest.raises(PhaseError, match="layers >= 1"):
        phase_sequence(x, [(ring_weights(2, 8), None)], 0)
    with pytest.raises(PhaseError, match="kinds"):
        phase_sequence(x, [], 2)
    with pytest.raises(PhaseError, match="style is one of"):
        phase_sequence(x, [(ring_weights(2, 8), None)], 1, "barrier")
    with pytest.raises(PhaseError, match="w must be fp32"):
        phase_sequence(x, [(torch.zeros(2, 9), None)], 1)
    with pytest.raises(PhaseError, match="power of two"):
        stream_buffers(1, 2, 1, words=96)
    with pytest.raises(PhaseError, match="power of two"):
        stream_buffers(1, 2, 1, words=2 * WORDS)


def test_stream_layout_picks_blocks_and_copies():
    assert floor.stream_layout(27.8, 640, 60 * 2**20)[:2] == (3, WORDS)  # 10,859 words a program
    blocks, words, copies = floor.stream_layout(1.3, 256, 60 * 2**20)  # 5 KB a program
    assert (blocks, words) == (1, 1024) and copies * 256 * 1024 * 4 >= 2 * 60 * 2**20
    assert floor.stream_layout(0.001, 100, 0) == (1, MIN_WORDS, 2)  # under the smallest block: one of it
    assert floor.stream_layout(13.9, 80, 0)[:2] == (11, WORDS)
    with pytest.raises(ValueError, match="at most 64"):
        floor.stream_layout(100.0, 1, 0)


def test_parse_layer():
    assert floor_step.parse_layer("96:4.2,64:0") == [(96, 4.2), (64, 0.0)]
    assert len(floor_step.parse_layer(floor_step.FRONTIER_LAYER)) == 7
    for bad in ("96", "96:x", "0:1", "4:-1", "4:nan"):
        with pytest.raises(ValueError, match="layer entry"):
            floor_step.parse_layer(bad)


def test_bench_rows_checks_and_table(tmp_path, monkeypatch):
    """A stub timer charging 2 us a launch plus 7 of graph overhead: the slope takes the overhead out;
    an ahead layer that cannot hold its words is skipped with the reason; a sequence that skips its
    last layer is caught."""
    launches = []
    real = floor_step.phase_sequence

    def counting(x, kinds, layers, style, first=0):
        launches.append(layers * len(kinds))
        real(x, kinds, layers, style, first)

    def timer(fn):
        launches.clear()
        fn()
        return 7.0 + 2.0 * launches[0]

    monkeypatch.setattr(floor_step, "phase_sequence", counting)
    layer = [(3, 0.01), (2, 0.0), (4, 0.002)]
    with open(tmp_path / "s.jsonl", "w") as f:
        rows = floor_step.bench_step(layer, layers=2, styles=("pdl", "pdl_ahead"), hidden=24, timer=timer,
                                     device="cpu", out=f)
    assert [r["style"] for r in rows] == ["pdl", "pdl_ahead"]
    for r in rows:
        assert r["us_layer"] == pytest.approx(6.0) and r["step_us"] == pytest.approx(12.0) and r["launches"] == 6
        assert r["mb_layer"] == pytest.approx((3 * 1 * 1024 + 4 * 1 * 128) * 4 / 1e6)
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 2
    t = floor_step.table(rows, copy_gbs=1.0)
    assert "| pdl_ahead | 6 | 0.01 | 6.00 | 0.012 | 83,333 |" in t
    skipped = floor_step.bench_step([(1, 0.3)], layers=1, styles=("pdl", "pdl_ahead"), hidden=8,
                                    timer=lambda fn: (fn(), 0.0)[1], device="cpu")
    assert "us_layer" in skipped[0] and "at most 12 blocks" in skipped[1]["skipped"]
    assert "skipped: an _ahead style" in floor_step.table(skipped)
    monkeypatch.setattr(floor_step, "phase_sequence",
                        lambda x, kinds, layers, style, first=0: real(x, kinds, layers - 1, style, first) if layers > 1
                        else None)
    with pytest.raises(RuntimeError, match="differs from the twin"):
        floor_step.bench_step(layer, layers=2, styles=("pdl",), hidden=24, timer=lambda fn: 0.0, device="cpu")


def test_cli_refuses_bad_arguments(capsys):
    for argv, msg in ((["--layer", "96"], "--layer: layer entry"), (["--styles", "pdl,barrier"], "--styles"),
                      (["--layers", "0"], "must be positive")):
        with pytest.raises(SystemExit):
            floor_step.main(argv)
        assert msg in capsys.readouterr().err


def test_cli_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        floor_step.main(["--layer", "2:0.001,1:0", "--layers", "1", "--hidden", "8", "--styles", "pdl"])
