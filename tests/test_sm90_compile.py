"""GPU-only kernel variants compile for sm_90a here (no GPU needed): PDL launches, every
fused-GEMV prologue / epilogue (dense, int4 and int8), the int4 per-group dot kernel, the int4 head's
pick, the verify pass's PDL launches (nothing read before the wait, the GEMMs' trigger after the
main loop), the q/k/v kernel and the step's start / advance / row-gather kernels, without register
spills, with the PDL wait after the dense kernels' weight loads and before the int4 kernel's first
load, and with the per-group kernel's inline PTX and tensor-core dots in place."""
import os
import subprocess
import sys
from pathlib import Path


def test_gpu_only_variants_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line.split("\t") for line in r.stdout.splitlines() if "\t" in line]
    rows = {f[0]: [int(x) for x in f[1:]] for f in lines
            if f[0] not in ("dot", "draft", "skinny", "packed", "norm", "pdl", "prefetch", "l2", "rope", "loop",
                            "stream", "floor", "accept", "head4", "head8", "edge", "rows")}
    pdl = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "pdl"}
    # the PDL kernels of the steps: one wait and one trigger each, nothing read before the wait (no
    # global load, no cp.async copy) but the norm kernels' parameters (the residual norm's post, pre
    # and layer scalar: 2 + 2 + 1 loads; the q/k/v kernel's norm weight: its two halves), the GEMMs'
    # trigger after their main loop (every mma before it), the attention's at once, no register more
    # than the plain launch (the parameters held across the wait: a few)
    params = {"residual norm": 5, "qkv finish sliding": 2, "qkv finish full": 2}
    assert set(pdl) == {"residual norm", "int4 per-group geglu split-4", "int4 per-group split-2", "skinny ple gate",
                        "qkv finish sliding", "qkv finish full", "attention split sliding", "attention split full",
                        "attention split sliding merged", "attention split full merged", "attention combine",
                        "attention split sliding per position", "attention split full per position"}
    for name, (regs, spills, waits, triggers, loads, mma_before, regs_plain, spills_plain) in pdl.items():
        assert (waits, triggers, loads) == (1, 1, params.get(name, 0)), (name, pdl[name])
        assert regs <= regs_plain + (8 if name in params else 0), (name, pdl[name])
        # the attention's split kernel (K and V tiles of 64 x 256 or 32 x 512 at 2 stages) runs at 255
        # registers and spills some hundred bytes with or without PDL; the others spill nothing. The
        # full layer's group tiles of 4 positions (the batch-invariant verify pass) spill 672 bytes
        # (320 with one position a tile) and still ran faster at every context (run IP: 2.070 -> 2.049
        # ms at 256 tokens, 3.214 -> 2.639 at 32,768)
        budget = 768 if name == "attention split full per position" else 512
        assert spills <= spills_plain <= budget if "split" in name else spills == 0, (name, pdl[name])
        gemm = "int4" in name or "skinny" in name
        assert mma_before > 0 if gemm else mma_before == 0, (name, pdl[name])
    # the attention's q/k/v mode: one wait and one trigger, the positions read and the first K / V
    # block loaded before the wait: into registers where `early_block` says so (the K / V loads there too:
    # no L2 prefetch at all), else prefetched into L2 (all the L2 prefetches there); no spills but one row of a
    # full layer over a long cache: its 32-key, 4-warp tiles spill up to a few hundred bytes (88-208
    # here), which ran faster than the spill-free 16-key, 8-warp tiles at every context; a short cache's
    # store layer takes 16 warps, spill-free (attention_tiles._qkv_tiles); the sliding layers merged
    # (fuse.attn_merge) spill nothing either
    pre = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "prefetch"}
    l2 = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "l2"}
    assert len(pre) == 10 and set(l2) == set(pre), (pre, l2)
    for name, (regs, spills, waits, triggers, loads, mma_before, regs_plain, spills_plain) in pre.items():
        budget = 512 if name.endswith(" full") else 0
        assert (waits, triggers) == (1, 1) and loads > 0, (name, pre[name])
        assert spills <= budget and spills_plain <= budget, (name, pre[name])
        before, after, early = l2[name]
        # E4B's tiles (attention_tiles._qkv_tiles): the sliding layers' at one row take the block early (not
        # the verify pass's per-position tiles)
        assert early == ("sliding" in name and not name.endswith(("8 rows", "per position"))), (name, l2[name])
        if early:  # the positions, the ring's slot positions, K's two halves and V: more loads than without
            assert before == after == 0 and loads > 4, (name, pre[name], l2[name])
        else:
            assert before > 0 and after == 0, (name, l2[name])
    # fuse.attn_tiles' e2 on the early tiles: the q rows' cos / sin loaded before the wait too, no spills
    rope = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "rope"}
    assert set(rope) == {n for n in pre if l2[n][2]}, rope
    for name, (regs, spills, loads1, loads2) in rope.items():
        assert regs <= 255 and spills == 0 and loads2 > loads1, (name, rope[name])
    # the persistent draft loop (E4B's drafter): 27 grid barriers per draft token, each one release
    # arrival and one acquire poll, the exit counter the only other GPU-scope atomic; at 255 registers
    # (one program per multiprocessor) it spills a few hundred bytes (384 with the first weight tiles
    # loaded before each barrier), as the attention's split kernel does
    loop = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "loop"}
    regs, spills, arrivals, polls, other = loop["draft loop E4B"]
    assert regs <= 255 and spills <= 512 and (arrivals, polls, other) == (27, 27, 1), loop
    # the streamed fused GEMV (kernels/stream_gemv.py): no spills at two programs a multiprocessor (<= 255
    # registers at 4 warps), one wait, its first blocks' weight loads before it and more after it
    stream = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "stream"}
    assert len(stream) == 2, stream
    for name, (regs, spills, waits, before, after) in stream.items():
        assert regs <= 255 and spills == 0 and waits == 1 and before > 0 and after > 0, (name, stream[name])
    # bench.floor's streamed phases: no spills; `pdl` sums its words before the trigger, `pdl_ahead`
    # after it (the next launch may start while they stream), `barrier_ahead` after its first poll
    floor = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "floor"}
    assert set(floor) == {"pdl", "pdl_ahead", "barrier_ahead"}, floor
    words = 4 * 4096
    for name, (regs, spills, loads, ands_before, ands_after) in floor.items():
        threads = 32 * (4 if name == "pdl" else 8)
        assert spills == 0 and loads >= words // threads // 4, (name, floor[name])
        held = (ands_before, ands_after) if name == "pdl" else (ands_after, ands_before)
        assert held[0] >= words // threads and held[1] <= 4, (name, floor[name])
    # the speculative step's accept (one warp): a barrier between the reads of the values it updates in place
    # and its writes, per batch row and before the step counter; the PTX lays the row loop out rotated, so
    # the stores before its first barrier are the previous row's tail (pos, hits, tries, the log: 4)
    # the step's edges in one launch each (kernels/step_start.py at E4B's and E2B's sizes, step_advance.py,
    # gather_rows.py): no spills, libdevice's cos / sin inlined (no call left, no approximate sin / cos: CUDA's cosf /
    # sinf, as torch's)
    edge = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "edge"}
    assert set(edge) == {"step start E4B", "step start E2B", "step advance", "gather rows"}, edge
    assert all(spills == 0 and calls == 0 and approx == 0 for _, spills, calls, approx in edge.values()), edge
    accept = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "accept"}
    regs, spills, bars, stores_before = accept["accept k=7 replay"]
    assert spills == 0 and bars == 2 and stores_before <= 4, accept
    # the int4 head's pick in the w4a16 GEMV's store: both loops compile without spills, storing the block's
    # max, its row and the logits (three global stores), at most 200 registers (the plain GEMV: 127 / 149)
    head4 = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "head4"}
    assert set(head4) == {"full head words", "pruned head words", "default bytes"}, head4
    assert all(sp == 0 and st == 3 and regs <= 200 for regs, sp, st in head4.values()), head4
    # the dense and int8 heads' one-row loops and quant=int8's (the same int8 loop, logits only): 16-byte loads, no I2F,
    # no spills; the int8 words without a barrier an iteration (no layout change through shared memory). The bf16
    # loop keeps its 8: without them (x read in w's shape) it ran slower (run KD)
    head8 = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "head8"}
    assert set(head8) == {"bf16 head", "int8 head words", "int8 body words"}, head8
    assert all(sp == 0 and i2f == 0 and v4 >= 4 for _, sp, i2f, v4, _ in head8.values()), head8
    assert head8["int8 head words"][4] == 0 and head8["int8 body words"][4] == 0, head8
    norms = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "norm"}
    assert len(norms) == 3 and all(sp == 0 for _, sp in norms.values()), norms  # residual_norm: no spills
    packed = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "packed"}
    # packed scale / zero words: no spills, and more cp.async copies than the plain kernel (the words
    # are streamed ahead with the codes instead of loaded in the loop)
    assert len(packed) == 2 and all(sp == 0 and mine > plain for _, sp, mine, plain in packed.values()), packed
    dots = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "dot"}
    heads = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "draft"}
    skinny = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "skinny"}
    # the skinny GEMM: no spills, tensor-core dots, one arrival atomic (its split-K fixup)
    assert len(skinny) == 2 and all(sp == 0 and mma > 0 and atoms == 1 for _, sp, mma, atoms in skinny.values()), skinny
    # the rows GEMV: no spills, one wait and one trigger, the weights' loads (5 blocks of 512 or 3 of 1,024, each
    # one or two vector loads a thread) all before the wait
    rows_k = {f[1]: [int(x) for x in f[2:]] for f in lines if f[0] == "rows"}
    assert len(rows_k) == 2 and all(sp == 0 and loads >= 3 and (w, t) == (1, 1)
                                    for _, sp, loads, w, t in rows_k.values()), rows_k
    # the epilogues cost no occupancy: registers within 8 of the plain kernel on the same rows per
    # program (GeGLU takes 32 gate + 32 up rows; over one tile of both runs it took 102-114 instead of 80)
    reg = {n: v[0] for n, v in dots.items()}
    assert reg["int4 per-group 16x32 split-2 gelu_mul"] <= reg["int4 per-group 16x32 split-2"] + 8, reg
    assert reg["int4 per-group 16x(2x32) split-2 geglu"] <= reg["int4 per-group 16x64 split-2"] + 8, reg
    # the drafter head: no spills; the select kernel's one arrival atomic (its last program picks); under
    # PDL one wait each, the select kernel reading nothing before it, the centroid kernel its rows
    assert set(heads) == {"draft head select", "draft head centroids"}, heads
    assert heads["draft head select"][1:5] == [0, 1, 1, 0], heads
    assert heads["draft head centroids"][1:4] == [0, 0, 1] and heads["draft head centroids"][4] > 0, heads
    assert len(rows) == 18 and len(dots) == 9, r.stdout  # rows: E2B's long-K int4 down too
    for name, (regs, spills, fmas, mmas, atoms, bars, cg_loads, split) in dots.items():
        # the inline PTX survived (8 packed fmas per 4 code bytes) and the dots run on tensor cores
        assert spills == 0 and fmas >= 8 and fmas % 8 == 0 and mmas > 0, (name, regs, spills, fmas, mmas)
        # split-K fixup: one acq_rel GPU-scope arrival atomic after a barrier (every thread's partial
        # written first), then the partials read from L2; none of it without splits
        if split > 1:
            assert atoms == 1 and bars >= 1 and cg_loads >= split, (name, atoms, bars, cg_loads)
        else:
            assert atoms == 0 and cg_loads == 0, (name, atoms, cg_loads)
    for name, (regs, spills, waits, loads_before_wait, k_blocks, pairs) in rows.items():
        assert spills == 0 and regs <= 255, (name, regs, spills)
        assert waits == 1, name
        # every weight block is loaded before the wait (>= one vector load per block), except in
        # the int4 word loop, which waits first
        if "words" in name:
            assert loads_before_wait == 0, (name, loads_before_wait)
        else:
            assert loads_before_wait >= k_blocks, (name, loads_before_wait)
        # the word loop's LOP3 survived: 4 pairs per word position and K block (at least); the int8 fused GEMV's
        # words become floats without an I2F (its column counts them: 0)
        assert pairs >= 4 * k_blocks if "words" in name else pairs == 0, (name, pairs)
