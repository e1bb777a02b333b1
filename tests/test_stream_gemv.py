"""The fused one-row GEMV streamed by a few programs (kernels/stream_gemv.py) against its twin
(fused_gemv_ref) under the CPU interpreter: every prologue / epilogue, programs that walk several
tiles, a look-ahead that runs past the last tile, more programs than tiles; its table syntax; its
benchmark's pick."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from test_fused_gemv import CASES, _tensors
from fastgemma.kernels import gemv, stream_gemv
from fastgemma.kernels.fused_gemv import fused_gemv, fused_gemv_ref, parse_fused_table, parse_tiles
from fastgemma.kernels.gemv import GemvConfig


@pytest.fixture
def one_sm(monkeypatch):
    """One 'multiprocessor': a config's per_sm is its program count, so small shapes give each
    program several tiles."""
    monkeypatch.setattr(gemv, "sm_count", lambda device: 1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("N,K,cfg", [
    (38, 300, GemvConfig(4, 64, 2, per_sm=2, depth=3)),    # K tail; 10 tiles (5 GeGLU) over 2 programs
    (22, 1024, GemvConfig(8, 64, 4, per_sm=3, depth=5)),   # 16 K blocks held as x; depth across tiles
    (64, 128, GemvConfig(2, 128, 1, per_sm=1, depth=1)),   # one program walks every tile, one block ahead
    (12, 96, GemvConfig(4, 32, 1, per_sm=64, depth=16)),   # more programs than tiles; look-ahead past the end
])
def test_stream_matches_twin(one_sm, case, N, K, cfg):
    t = _tensors(N, K, torch.float32, seed=N)
    build, epi = CASES[case]
    kw = dict(build(t), eps=1e-6, epilogue=epi)
    out, h = fused_gemv(t["a"], t["w"], config=cfg, **kw)
    ref, href = fused_gemv_ref(t["a"], t["w"], **kw)
    assert out.shape == ref.shape == (1, N // 2 if epi == "geglu" else N)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    if "y" in kw:  # the new residual, written once (tile 0)
        assert torch.allclose(h, href, atol=1e-6)
    else:
        assert h is None


@pytest.mark.parametrize("case", ["residual_scale_norm", "geglu", "ple_gate"])
def test_stream_rounds_as_the_one_tile_kernel(one_sm, case):
    """fp16: the streamed kernel's x (kept in fp16) and epilogue round at the points of
    kernels/fused_gemv.py's one-program-per-tile kernel: the same values."""
    N, K = 40, 256
    t = _tensors(N, K, torch.float16, seed=7)
    build, epi = CASES[case]
    kw = dict(build(t), eps=1e-6, epilogue=epi)
    tile = fused_gemv(t["a"], t["w"], config=GemvConfig(4, 64, 2), **kw)
    stream = fused_gemv(t["a"], t["w"], config=GemvConfig(4, 64, 2, per_sm=3, depth=4), **kw)
    ref = fused_gemv_ref(t["a"], t["w"], **kw)[0]
    assert ((stream[0].float() - tile[0].float()).abs().max() / ref.float().abs().max()).item() < 2e-3
    if "y" in kw:
        assert torch.equal(stream[1], tile[1])


def test_table_entries_with_streamed_tiles():
    t = parse_fused_table("gate|up=8x512w4p2d8,down=2x1024w4")
    assert t[(20480, 2560, True, "geglu")] == GemvConfig(8, 512, 4, per_sm=2, depth=8)
    assert t[(2560, 10240, False, "none")] == GemvConfig(2, 1024, 4)
    for bad in ("gate|up=8x512w4p2", "gate|up=8x512w4p2d0", "gate|up=8x512w4p2d17", "gate|up=8x512w4p0d4"):
        with pytest.raises(ValueError, match="fused table entry"):
            parse_fused_table(bad)
    assert parse_tiles("4x1024w8p1d4") == GemvConfig(4, 1024, 8, per_sm=1, depth=4)


def test_bench_picks_the_fastest_checked_tiles(one_sm, capsys):
    """bench_stream on the CPU (a stub timer: given times in call order): every output checked
    against the twin, a tile that cannot hold the case's K blocks skipped (not timed), and the last
    line a --fused-table value with each case's fastest tiles."""
    times = iter([5.0, 2.0, 3.0, 4.0,   # gate|up: shipped, then the three tiles
                  5.0, 3.0, 1.0])       # plain: shipped, two tiles (2x8 skipped)

    def timer(fn):
        fn()
        return next(times)

    rows = stream_gemv.bench_stream({"gate|up": (40, 96, True, "geglu"), "plain": (24, 200, False, "none")},
                                    ["4x32w1p1d2", "4x64w2p2d3", "2x8w1p1d1"], dtype=torch.float32, timer=timer,
                                    device="cpu")
    out = capsys.readouterr().out
    assert len(rows) == 7 and all(r["ok"] for r in rows)
    assert [r["tiles"] for r in rows if r["case"] == "plain"] == ["shipped", "4x32w1p1d2", "4x64w2p2d3"]
    assert "skip 2x8w1p1d1" in out  # 200 / 8 = 25 K blocks: more than a program holds
    assert out.strip().splitlines()[-1] == "fused table: +gate|up=4x32w1p1d2,plain=4x64w2p2d3"
