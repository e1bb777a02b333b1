"""Compile GPU-only kernel variants for sm_90a on a machine without a GPU (Triton front end +
the bundled ptxas): PDL launches, every fused-GEMV prologue / epilogue, and the int4 per-group
tl.dot kernel with its inline-PTX bf16 dequantization. Run as a script (the
interpreter must be off); prints one line per variant: name, registers, spill bytes."""
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastgemma.kernels import draft_loop as dl
from fastgemma.kernels.attention_tiles import SHORT_CACHE, _qkv_tiles, early_block
from fastgemma.kernels.decode_attention import _combine_kernel, _split_kernel
from fastgemma.kernels.draft_head import CENTROID_BLOCK, _centroid_kernel, _select_kernel
from fastgemma.kernels.fused_gemv import _fused_gemv_kernel
from fastgemma.kernels.fused_w4a16 import _fused_w4a16_kernel
from fastgemma.kernels.fused_w8a16 import _fused_w8a16_kernel
from fastgemma.kernels.gemv import _prefetch_gemv_kernel
from fastgemma.kernels.qkv_finish import _qkv_finish_kernel
from fastgemma.kernels.residual_norm import _residual_norm_kernel
from fastgemma.kernels.rows_gemv import _rows_gemv_kernel
from fastgemma.kernels.skinny_gemm import _dense_mma_kernel
from fastgemma.kernels.stream_gemv import _stream_gemv_kernel
from fastgemma.kernels.w4a16 import _group_mma_kernel

D16 = [["tt.divisibility", 16]]
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _ptxas(ptx: str, d: str) -> subprocess.CompletedProcess:
    """ptx assembled for sm_90a into d/k.cubin (-v: registers and spills on stderr); exits on an error."""
    path = os.path.join(d, "k.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")], capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(r.stderr)
    return r


def sass(ptx: str) -> str:
    """The sm_90a SASS of a PTX text (the bundled ptxas and cuobjdump)."""
    with tempfile.TemporaryDirectory() as d:
        _ptxas(ptx, d)
        return subprocess.run([os.path.join(os.path.dirname(PTXAS), "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout


def build(fn, sig, constexprs, aligned, warps, stages=None, maxnreg=None):
    sig = dict(sig, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn, sig, constexprs=constexprs, attrs={(i,): D16 for i in aligned})
    options = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:  # a launch's register cap (mma_table.MmaConfig.regs)
        options["maxnreg"] = maxnreg
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        r = _ptxas(ptx, d)
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", r.stderr))
    return ptx, regs, spills


def main():
    gemv_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "stride_xm": "i32",
                "stride_wn": "i32", "stride_om": "i32"}
    fused_sig = {n: "*bf16" for n in ("a_ptr", "y_ptr", "post_ptr", "scale_ptr", "pre_ptr", "h_ptr", "w_ptr",
                                      "aux_ptr", "out_ptr")}
    fused_sig.update(N="i32", HALF="i32", stride_wn="i32", eps="fp32", off="fp32")
    cases = [("gemv pdl gate|up", _prefetch_gemv_kernel, gemv_sig, dict(K=2560, BLOCK_N=8, BLOCK_K=512, PDL=True),
              (0, 1, 2, 4, 5, 6), 4)]
    for name, pro, epi, K, bn, bk, warps in [
            ("fused plain down", 0, 0, 10240, 1, 1024, 4), ("fused input-norm qkv", 1, 0, 2560, 8, 512, 4),
            ("fused residual qkv", 2, 0, 2560, 8, 512, 4), ("fused geglu gate|up", 2, 1, 2560, 8, 512, 4),
            ("fused geglu gate|up wide", 2, 1, 2560, 32, 512, 8), ("fused ple gate", 2, 2, 2560, 1, 1024, 4)]:
        ce = dict(K=K, BLOCK_N=bn, BLOCK_K=bk, PRO=pro, HAS_SCALE=pro == 2 and epi == 0,
                  HAS_PRE=pro == 1 or (pro == 2 and epi != 2), EPI=epi, PDL=True)
        cases.append((name, _fused_gemv_kernel, fused_sig, ce, tuple(range(9)) + (11,), warps))
    int4_sig = {n: "*bf16" for n in ("a_ptr", "y_ptr", "post_ptr", "scale_ptr", "pre_ptr", "h_ptr")}
    int4_sig.update(qw_ptr="*u8", s_ptr="*bf16", z_ptr="*bf16", aux_ptr="*bf16", out_ptr="*bf16", N="i32", HALF="i32",
                    eps="fp32", off="fp32")
    for name, pro, epi, K, bn, bk, warps, words in [
            ("int4 fused residual qkv", 2, 0, 2560, 4, 512, 4, False),
            ("int4 fused geglu gate|up", 2, 1, 2560, 8, 512, 4, False),
            ("int4 fused plain down", 0, 0, 10240, 4, 1024, 4, False), ("int4 fused ple gate", 2, 2, 2560, 4, 512, 4, False),
            ("int4 fused words geglu gate|up", 2, 1, 2560, 16, 512, 2, True),
            ("int4 fused words residual qkv full", 2, 0, 2560, 4, 512, 1, True)]:
        ce = dict(K=K, GROUP=128, BLOCK_N=bn, BLOCK_K=bk, PRO=pro, HAS_SCALE=pro == 2 and epi == 0,
                  HAS_PRE=pro == 2 and epi != 2, EPI=epi, PDL=True, WORDS=words, ASM=True, EXACT=False)
        cases.append((name, _fused_w4a16_kernel, int4_sig, ce, tuple(range(11)), warps))
    # E2B's down (1,536 x 12,288, no tile in the tables) on the default tile widened for its long K
    from fastgemma.kernels.fused_w4a16 import _fit_long_k
    from fastgemma.kernels.w4a16_table import resolve_config

    c = _fit_long_k(resolve_config(1, 1536, 12288, 128), 1536, 12288, 128)
    cases.append(("int4 fused plain down E2B", _fused_w4a16_kernel, int4_sig,
                  dict(K=12288, GROUP=128, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PRO=0, HAS_SCALE=False, HAS_PRE=False,
                       EPI=0, PDL=True, WORDS=c.words, ASM=True, EXACT=False), tuple(range(11)), c.num_warps))
    # quant=int8's fused GEMV (kernels/fused_w8a16.py, its codes as int32 words) on the dense one's pinned tiles
    int8_sig = {n: "*bf16" for n in ("a_ptr", "y_ptr", "post_ptr", "scale_ptr", "pre_ptr", "h_ptr")}
    int8_sig.update(w_ptr="*i8", ws_ptr="*fp32", aux_ptr="*bf16", out_ptr="*bf16", N="i32", HALF="i32",
                    stride_wn="i32", eps="fp32", off="fp32")
    for name, pro, epi, K, bn, bk, warps in [
            ("int8 fused residual qkv", 2, 0, 2560, 8, 1024, 4), ("int8 fused geglu gate|up", 2, 1, 2560, 8, 512, 4),
            ("int8 fused plain down", 0, 0, 10240, 2, 1024, 4), ("int8 fused ple gate", 2, 2, 2560, 1, 1024, 4)]:
        ce = dict(K=K, BLOCK_N=bn, BLOCK_K=bk, PRO=pro, HAS_SCALE=pro == 2 and epi == 0,
                  HAS_PRE=pro == 2 and epi != 2, EPI=epi, PDL=True, WORDS=True)
        cases.append((name, _fused_w8a16_kernel, int8_sig, ce, tuple(range(10)) + (12,), warps))
    # the per-group int4 tl.dot kernel with its bf16 PTX dequantization: tensor-core dots, the
    # asm's packed fmas, no spills ("dot" lines: name, registers, spills, bf16x2 fmas, mma instructions)
    # split 4 with the fixup: the last program of a tile sums the partials (an acq_rel atomic at GPU
    # scope after a barrier, then L2 loads), extra columns: atomics, barriers before the first one, .cg loads
    dot_sig = {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
               "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_qn": "i32",
               "stride_om": "i32", "aux_ptr": "*bf16", "stride_am": "i32"}
    # the epilogue variants (the verify pass's gate|up and PLE gate, 2 warps, split 2) beside the plain
    # kernel on the same rows per program: registers (occupancy) must not grow with the epilogue
    for name, bn, warps, even, split, epi in [("int4 per-group 16x32", 32, 2, True, 1, 0),
                                              ("int4 per-group 16x64", 64, 4, True, 1, 0),
                                              ("int4 per-group 16x128 tail", 128, 8, False, 1, 0),
                                              ("int4 per-group 16x64 split-4 fixup", 64, 4, True, 4, 0),
                                              ("int4 per-group 16x32 split-2", 32, 2, True, 2, 0),
                                              ("int4 per-group 16x64 split-2", 64, 2, True, 2, 0),
                                              ("int4 per-group 16x64 2 warps split-8", 64, 2, True, 8, 0),
                                              ("int4 per-group 16x32 split-2 gelu_mul", 32, 2, True, 2, 2),
                                              ("int4 per-group 16x(2x32) split-2 geglu", 32, 2, True, 2, 1)]:
        ce = dict(K_SPLIT=2560 // split, SPLIT=split, FIXUP=split > 1, GROUP=128, BLOCK_M=16, BLOCK_N=bn,
                  EVEN_N=even, ASM=True, DOT_PRECISION="tf32", EPI=epi, HALF=10240 if epi == 1 else 0)
        aligned = (0, 1, 2, 3, 4, 5, 6, 10) if epi == 0 and split != 2 else (0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13)
        ptx, regs, spills = build(_group_mma_kernel, dot_sig, ce, aligned, warps)
        mma = ptx.count("mma.sync") + ptx.count("wgmma.mma_async")
        atom = ptx.find("atom.")
        atoms = len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx))
        bars = ptx[:atom].count("bar.sync") if atom >= 0 else 0
        print(f"dot\t{name}\t{regs}\t{spills}\t{ptx.count('fma.rn.bf16x2')}\t{mma}\t{atoms}\t{bars}\t"
              f"{ptx.count('ld.global.cg')}\t{split}")
    # packed scale / zero words (SZ): one int32 per row and group, which the pipeliner streams with
    # cp.async like the codes ("packed" lines: name, registers, spills, the packed kernel's cp.async
    # copies, the plain kernel's, on the same tiles)
    for name, epi in [("int4 per-group 16x32 split-2 packed", 0), ("int4 per-group 16x(2x32) split-2 geglu packed", 1)]:
        ce = dict(K_SPLIT=1280, SPLIT=2, FIXUP=True, GROUP=128, BLOCK_M=16, BLOCK_N=32, EVEN_N=True, ASM=True,
                  DOT_PRECISION="tf32", EPI=epi, HALF=10240 if epi == 1 else 0)
        aligned = (0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13)
        plain, _, _ = build(_group_mma_kernel, dot_sig, dict(ce, SZ=False), aligned, 2)
        ptx, regs, spills = build(_group_mma_kernel, dict(dot_sig, s_ptr="*i32", z_ptr="*i32"), dict(ce, SZ=True),
                                  aligned, 2)
        copies = [len(re.findall(r"cp\.async\.c[ag]\.shared", t)) for t in (ptx, plain)]
        print(f"packed\t{name}\t{regs}\t{spills}\t{copies[0]}\t{copies[1]}")
    # the skinny GEMM (the PLE gate with gelu_mul, split 10 through the fixup; geglu): no spills,
    # tensor-core dots ("skinny" lines: name, registers, spills, mma instructions, atomics)
    sk_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
              "aux_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32",
              "stride_am": "i32"}
    for name, epi, split in [("skinny ple gate gelu_mul", 2, 10), ("skinny geglu", 1, 2)]:
        ce = dict(HALF=128 if epi == 1 else 0, K_SPLIT=2560 // split, SPLIT=split, FIXUP=True, BLOCK_M=16, BLOCK_N=16,
                  BLOCK_K=128, EPI=epi, EVEN_N=True, DOT_PRECISION="tf32")
        ptx, regs, spills = build(_dense_mma_kernel, sk_sig, ce, (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11), 2)
        mma = ptx.count("mma.sync") + ptx.count("wgmma.mma_async")
        print(f"skinny\t{name}\t{regs}\t{spills}\t{mma}\t{len(re.findall(r'atom.global.gpu.acq_rel.add', ptx))}")
    # the rows GEMV (the PLE gate with gelu_mul on its default tiles, and one weight row of 1,024 columns a
    # program): no spills, every weight load before the PDL wait ("rows" lines: name, registers, spills, global
    # loads before the wait, waits, triggers)
    rows_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "aux_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "HALF": "i32",
                "stride_wn": "i32", "stride_xm": "i32", "stride_am": "i32", "stride_om": "i32"}
    for name, bn, bk, warps in [("rows ple gate 2x512", 2, 512, 2), ("rows ple gate 1x1024", 1, 1024, 2)]:
        ptx, regs, spills = build(_rows_gemv_kernel, rows_sig, dict(K=2560, BLOCK_N=bn, BLOCK_K=bk, EPI=2, PDL=True),
                                  (0, 1, 2, 3, 6, 7, 8, 9), warps)
        wait = ptx.find("griddepcontrol.wait")
        print(f"rows\t{name}\t{regs}\t{spills}\t{len(re.findall(r'ld[.]global', ptx[:wait]))}\t"
              f"{ptx.count('griddepcontrol.wait')}\t{ptx.count('griddepcontrol.launch_dependents')}")
    # the wider step's residual update + norm, a 2,560-wide row in registers (8 warps): no spills
    # ("norm" lines: name, registers, spills)
    rn_sig = {n: "*bf16" for n in ("a_ptr", "y_ptr", "post_ptr", "scale_ptr", "pre_ptr", "h_ptr", "x_ptr")}
    rn_sig.update(stride_a="i32", stride_y="i32", stride_h="i32", stride_x="i32", eps="fp32", off="fp32")
    for name, has_y, has_scale, has_pre in [("residual norm", True, False, True),
                                            ("residual scale norm", True, True, True), ("norm", False, False, True)]:
        ce = dict(K=2560, BLOCK=4096, HAS_Y=has_y, HAS_SCALE=has_scale, HAS_PRE=has_pre)
        _, regs, spills = build(_residual_norm_kernel, rn_sig, ce, tuple(range(11)), 8)
        print(f"norm\t{name}\t{regs}\t{spills}")
    # PDL launches of the verify pass's kernels ("pdl" lines: name, registers, spills, waits, launch
    # triggers, global loads / cp.async copies before the wait, mma instructions before the trigger,
    # registers and spill bytes without PDL)
    def pdl_line(name, fn, sig, ce, aligned, warps, stages=None):
        ptx, regs, spills = build(fn, sig, dict(ce, PDL=True), aligned, warps, stages)
        _, regs0, spills0 = build(fn, sig, dict(ce, PDL=False), aligned, warps, stages)
        wait, trig = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        loads = len(re.findall(r"ld[.]global|cp[.]async[.]c[ag]", ptx[:wait]))
        print(f"pdl\t{name}\t{regs}\t{spills}\t{ptx.count('griddepcontrol.wait')}\t"
              f"{ptx.count('griddepcontrol.launch_dependents')}\t{loads}\t{ptx[:trig].count('mma.sync')}\t{regs0}\t"
              f"{spills0}")

    for name, epi, split in [("int4 per-group geglu split-4", 1, 4), ("int4 per-group split-2", 0, 2)]:
        ce = dict(K_SPLIT=2560 // split, SPLIT=split, FIXUP=True, GROUP=128, BLOCK_M=16, BLOCK_N=32, EVEN_N=True,
                  ASM=True, DOT_PRECISION="tf32", EPI=epi, HALF=10240 if epi == 1 else 0, SZ=True)
        pdl_line(name, _group_mma_kernel, dict(dot_sig, s_ptr="*i32", z_ptr="*i32"), ce,
                 (0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13), 2)
    ce = dict(HALF=0, K_SPLIT=256, SPLIT=10, FIXUP=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, EPI=2, EVEN_N=True,
              DOT_PRECISION="tf32")
    pdl_line("skinny ple gate", _dense_mma_kernel, sk_sig, ce, (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11), 2)
    pdl_line("residual norm", _residual_norm_kernel, rn_sig,
             dict(K=2560, BLOCK=4096, HAS_Y=True, HAS_SCALE=True, HAS_PRE=True), tuple(range(11)), 8)
    # the q/k/v kernel of a sliding store layer (D 256) and a full one (D 512, 2 warps)
    qkv_sig = {"qkv_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
               "idx_ptr": "*i64", "q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "T": "i32",
               "stride_qkv": "i32", "stride_cs": "i32", "stride_ib": "i32", "stride_it": "i32", "stride_cb": "i32",
               "stride_cs_slot": "i32", "stride_ch": "i32", "eps": "fp32", "off": "fp32"}
    for name, D, warps in [("qkv finish sliding", 256, 1), ("qkv finish full", 512, 2)]:
        pdl_line(name, _qkv_finish_kernel, qkv_sig, dict(H=8, HKV=2, D=D, V_NORM=True), tuple(range(9)), warps)
    # the attention's split kernel on a sliding ring layer (D 256) and a full layer (D 512) at one row
    # (4 query heads per KV head: a 16-row tile), and the combine kernel
    # (unit strides along D and of the ring positions are constexprs, as Triton specialises them)
    split_sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr")}
    split_sig.update(qpos_ptr="*i64", spos_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16")
    split_sig.update({n: "i32" for n in ("S", "T", "G", "Hkv", "R", "num_splits", "window")}, qk_scale="fp32")
    split_sig.update({f"s{t}_{d}": "i32" for t in "qkvo" for d in ("b", "t" if t in "qo" else "s", "h")})
    split_sig.update(sqp_b="i32", sqp_t="i32", ssp_b="i32", cnt_ptr="*i32")
    split_sig.update({n: "*bf16" for n in ("qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr")}, idx_ptr="*i64")
    split_sig.update({n: "i32" for n in ("scs_b", "scs_t", "sid_b", "sid_t")}, eps="fp32", norm_off="fp32")
    units = dict(sq_d=1, sk_d=1, sv_d=1, so_d=1, ssp_s=1)
    # (merged: the largest merges MERGE_MAX_ELEMS allows, 8 splits x 4 rows at D 256, 4 x 4 at 512)
    # (per position: the verify pass's group tiles under fuse.batch_invariant, 4 positions a tile)
    for name, D, bn, slot, merge in [("attention split sliding", 256, 64, True, False),
                                     ("attention split full", 512, 32, False, False),
                                     ("attention split sliding merged", 256, 64, True, True),
                                     ("attention split full merged", 512, 32, False, True),
                                     ("attention split sliding per position", 256, 64, True, False),
                                     ("attention split full per position", 512, 32, False, False)]:
        ce = dict(units, D=D, BLOCK_D=D, BLOCK_M=16, BLOCK_N=bn, HAS_SLOT_POS=slot, SPLIT=True, IEEE=False,
                  FIXUP=merge, BLOCK_S=(8 if D == 256 else 4) if merge else 1, MERGE_M=4 if merge else 1, QKV=0,
                  V_NORM=False, BLOCK_T=16, EMU=False, POS_TILE=name.endswith("per position"), POS_Q=4)
        pdl_line(name, _split_kernel, split_sig, ce, tuple(range(8)), 4, 2)  # decode_attention's tiles
    # the q/k/v mode (decode_attention_qkv): a store layer at 1 and 8 rows (its own K / V rows made
    # and stored), a query-only one; the positions and the first K / V block loaded before the wait (into
    # registers where `early_block` says so, else into L2)
    # ("prefetch" lines as the pdl ones: name, registers, spills, waits, triggers, loads before the wait,
    # mma before the trigger, registers and spill bytes without PDL)
    for name, D, slot, bm, qkv in [("attention qkv store sliding", 256, True, 16, 2),
                                   ("attention qkv store full", 512, False, 16, 2),
                                   ("attention qkv store sliding 8 rows", 256, True, 32, 2),
                                   ("attention qkv store full 8 rows", 512, False, 32, 2),
                                   ("attention qkv query-only sliding", 256, True, 16, 1),
                                   ("attention qkv query-only full", 512, False, 16, 1),
                                   ("attention qkv store full short cache", 512, False, 16, 2),
                                   ("attention qkv store sliding merged", 256, True, 16, 2),
                                   ("attention qkv query-only sliding merged", 256, True, 16, 1),
                                   ("attention qkv query-only sliding per position", 256, True, 16, 1)]:
        # the tiles the kernel launches with (a cache of 32k slots, or SHORT_CACHE)
        bn, warps, stages = _qkv_tiles(D, bm, SHORT_CACHE if "short" in name else 32784, qkv == 2)
        merge = name.endswith("merged")  # E4B's sliding layers at one row: 7 / 6 splits of 4 rows, merged
        early = early_block(qkv, bm, bn, D, 2, warps, name.endswith("per position"))
        ce = dict(units, D=D, BLOCK_D=D, BLOCK_M=bm, BLOCK_N=bn, HAS_SLOT_POS=slot, SPLIT=True, IEEE=False,
                  FIXUP=merge, BLOCK_S=8 if merge else 1, MERGE_M=4 if merge else 1, QKV=qkv, V_NORM=True,
                  BLOCK_T=16, EMU=False, POS_TILE=name.endswith("per position"), POS_Q=4, EARLY=early)
        with contextlib.redirect_stdout(io.StringIO()) as buf:
            pdl_line(name, _split_kernel, split_sig, ce, tuple(range(8)), warps, stages)
        print(buf.getvalue().replace("pdl\t", "prefetch\t", 1), end="")
        ptx, _, _ = build(_split_kernel, split_sig, dict(ce, PDL=True), tuple(range(8)), warps, stages)
        wait = ptx.find("griddepcontrol.wait")
        print(f"l2\t{name}\t{ptx[:wait].count('prefetch.global.L2')}\t{ptx[wait:].count('prefetch.global.L2')}\t"
              f"{int(early)}")
        if early:  # fuse.attn_tiles' e2: the q rows' cos / sin before the wait too ("rope" lines: name, registers,
            # spills, global loads before the wait with e1, with e2)
            ptx2, regs2, spills2 = build(_split_kernel, split_sig, dict(ce, PDL=True, EARLY=2), tuple(range(8)), warps,
                                         stages)
            print(f"rope\t{name}\t{regs2}\t{spills2}\t{len(re.findall(r'ld[.]global', ptx[:wait]))}\t"
                  f"{len(re.findall(r'ld[.]global', ptx2[:ptx2.find('griddepcontrol.wait')]))}")
    comb_sig = {"o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16", "G": "i32", "Hkv": "i32", "R": "i32",
                "num_splits": "i32", "so_b": "i32", "so_t": "i32", "so_h": "i32"}
    pdl_line("attention combine", _combine_kernel, comb_sig, dict(D=256, BLOCK_S=8, BLOCK_DC=256, so_d=1), (0, 1, 2),
             4)
    # the drafter head (E4B: 2,048 centroids of 128 tokens, hidden 256, top 32): no spills, one
    # arrival atomic in the select kernel ("draft" lines: name, registers, spills, atomics)
    head_sig = {"s_ptr": "*bf16", "g_ptr": "*bf16", "order_ptr": "*i64", "emb_ptr": "*bf16", "pmax_ptr": "*fp32",
                "pord_ptr": "*i32", "ptok_ptr": "*i64", "cnt_ptr": "*i32", "out_ptr": "*i64", "C": "i32",
                "TPC": "i32", "stride_sn": "i32", "stride_gn": "i32"}
    def head_line(name, fn, sig, ce, aligned):
        """name, registers, spills, arrival atomics, PDL waits, global loads before the wait (PDL build)."""
        ptx, regs, spills = build(fn, sig, dict(ce, PDL=True), aligned, 4)
        wait = ptx.find("griddepcontrol.wait")
        print(f"draft\t{name}\t{regs}\t{spills}\t{ptx.count('atom.global.gpu.acq_rel')}\t"
              f"{ptx.count('griddepcontrol.wait')}\t{len(re.findall(r'ld[.]global', ptx[:wait]))}")

    head_line("draft head select", _select_kernel, head_sig, dict(H=256, TOP_K=32, BLOCK_C=2048, BLOCK_T=32,
                                                                  BLOCK_H=64, BLOCK_P=128, KEY_SHIFT=16, S=4),
              tuple(range(9)))
    cent_sig = {"g_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "C": "i32", "stride_gn": "i32",
                "stride_sn": "i32"}
    head_line("draft head centroids", _centroid_kernel, cent_sig, dict(H=256, BLOCK_C=CENTROID_BLOCK, BLOCK_H=64),
              (0, 1, 2))
    draft_loop_line()
    head4_lines()
    head8_lines()
    accept_line()
    step_edge_lines()
    stream_lines()
    floor_lines()
    for name, fn, sig, ce, aligned, warps in cases:
        ptx, regs, spills = build(fn, sig, ce, aligned, warps)
        waits = ptx.count("griddepcontrol.wait")
        # the PDL wait comes after every weight block's loads (a prefetch)
        first_wait = ptx.index("griddepcontrol.wait")
        w_loads_before = ptx[:first_wait].count("ld.global")
        expect = -(-ce["K"] // ce["BLOCK_K"])
        # the int4 word loop's nibble pairs: one LOP3 with the 0x3F803F80 magic per pair of codes; the int8 kernel's
        # int-to-float conversions (none from its words)
        pairs = (ptx.count("0x3F803F80") if ce.get("WORDS") and fn is _fused_w4a16_kernel else
                 ptx.count("cvt.rn.f32.s") if fn is _fused_w8a16_kernel else 0)
        print(f"{name}\t{regs}\t{spills}\t{waits}\t{w_loads_before}\t{expect}\t{pairs}")


def stream_lines():
    """The streamed fused GEMV on E4B's bf16 gate|up and down ("stream" lines: name, registers, spill
    bytes, PDL waits, global loads before the wait, after it)."""
    sig = {n: "*bf16" for n in ("a_ptr", "y_ptr", "post_ptr", "scale_ptr", "pre_ptr", "h_ptr", "w_ptr", "aux_ptr",
                                "out_ptr")}
    sig.update(N="i32", HALF="i32", stride_wn="i32", eps="fp32", off="fp32")
    for name, pro, epi, K, nt, bn, bk, warps, depth in [("gate|up 8x512w4p2d8", 2, 1, 2560, 2560, 8, 512, 4, 8),
                                                        ("down 2x1024w4p2d8", 0, 0, 10240, 1280, 2, 1024, 4, 8)]:
        ce = dict(K=K, BLOCK_N=bn, BLOCK_K=bk, PRO=pro, HAS_SCALE=False, HAS_PRE=pro == 2, EPI=epi, PDL=True,
                  DEPTH=depth, NT=nt, P=264)
        ptx, regs, spills = build(_stream_gemv_kernel, sig, ce, tuple(range(9)) + (11,), warps, stages=1)
        wait = ptx.find("griddepcontrol.wait")
        print(f"stream\t{name}\t{regs}\t{spills}\t{ptx.count('griddepcontrol.wait')}\t"
              f"{ptx[:wait].count('ld.global')}\t{ptx[wait:].count('ld.global')}")


def floor_lines():
    """bench.floor's streamed phases, 4 blocks of 16 KB a program ("floor" lines: name, registers, spill
    bytes, global loads before the boundary, low-bit ANDs before it, after it). The boundary: the PDL
    trigger in the PTX (a launch); for `barrier_ahead`, whose loop the PTX lays out rotated, the first
    poll in its SASS (cuobjdump), its streamed blocks' 16-byte loads and ANDs counted there."""
    from fastgemma.kernels.phase_floor import WORDS, _persistent_kernel, _phase_kernel, ahead_warps

    def split(ptx, mark):
        at = ptx.index(mark)
        ands = [m.start() for m in re.finditer(r"and\.b32\s+%r\d+, %r\d+, 1;", ptx)]
        return (len(re.findall(r"ld\.global", ptx[:at])), sum(a < at for a in ands), sum(a > at for a in ands))

    sig = dict(src="*fp32", dst="*fp32", w_ptr="*fp32", H="i32", C="i32", big_ptr="*i32", sink_ptr="*i32", base="i32")
    for ahead in (False, True):
        ce = dict(WORK=True, PDL=True, AHEAD=ahead, BLOCK=4096, BLOCK_C=32, NB=4, WB=WORDS)
        ptx, regs, spills = build(_phase_kernel, sig, ce, (0, 1, 2, 5, 6), ahead_warps(4, ahead))
        counts = split(ptx, "griddepcontrol.launch_dependents")
        print("floor\t" + "\t".join(map(str, ("pdl_ahead" if ahead else "pdl", regs, spills) + counts)))
    psig = dict(x_ptr="*fp32", w_ptr="*fp32", bar_ptr="*i32", err_ptr="*i32", n="i32", H="i32", C="i32",
                big_ptr="*i32", sink_ptr="*i32", copies="i32")
    ce = dict(WORK=True, BLOCK=4096, BLOCK_C=32, SPIN=1 << 26, NB=4, WB=WORDS, AHEAD=True)
    ptx, regs, spills = build(_persistent_kernel, psig, ce, (0, 1, 2, 3, 7, 8), ahead_warps(4, True))
    code = sass(ptx)
    at = code.index("LDG.E.STRONG.GPU")  # the poll
    ands = [m.start() for m in re.finditer(r"LOP3\.LUT R\d+, R\d+, 0x1, RZ, 0xc0", code)]
    counts = (code[:at].count("LDG.E.128"), sum(a < at for a in ands), sum(a > at for a in ands))
    print("floor\t" + "\t".join(map(str, ("barrier_ahead", regs, spills) + counts)))


def head4_lines():
    """The int4 head's pick in the w4a16 GEMV's store (kernels/sparse_argmax.head_argmax_int4) on E4B's full
    head tiles (the word loop, 32 rows x 512 k, 2 warps), the pruned head's (16 x 512, 2 warps) and the byte
    loop of the other shapes' default (8 x 512, 4 warps), with stored logits and a keepset ("head4" lines:
    name, registers, spill bytes, global stores: the block's max, its row, the logits)."""
    from fastgemma.kernels.w4a16 import _gemv_kernel

    sig = {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*fp32", "ws_ptr": "*fp32",
           "cnt_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_qn": "i32", "stride_om": "i32",
           "pmax_ptr": "*fp32", "pidx_ptr": "*i32", "keep_ptr": "*i64", "logit_ptr": "*fp32", "stride_lm": "i32",
           "softcap": "fp32"}
    for name, bn, words, warps in (("full head words", 32, True, 2), ("pruned head words", 16, True, 2),
                                   ("default bytes", 8, False, 4)):
        ce = dict(K_SPLIT=2560, SPLIT=1, FIXUP=False, GROUP=128, BLOCK_N=bn, BLOCK_K=512, FACTORED=True, WORDS=words,
                  ASM=True, EXACT=False, ARGMAX=True, NUM_P=262144 // bn, HAS_KEEP=True, STORE_LOGITS=True,
                  WANT_IDS=True, SOFTCAP=True)
        ptx, regs, spills = build(_gemv_kernel, sig, ce, (0, 1, 2, 3, 12, 13, 14, 15), warps)
        print(f"head4\t{name}\t{regs}\t{spills}\t{len(re.findall(r'st[.]global', ptx))}")


def head8_lines():
    """The dense / int8 head's one-row pick (kernels/sparse_argmax.py at its default tiles: bf16 rows, int8 rows read
    as int32 words), and the same int8 loop as quant=int8's one-row matmul (kernels/w8a16.py: the logits store of
    every row, no keepset, argmax or softcap): "head8" lines: name, registers, spill bytes, I2F conversions,
    16-byte loads and barriers in the K loop."""
    from fastgemma.kernels.sparse_argmax import GEMV_CONFIG, INT8_GEMV_CONFIG, _head_block_kernel

    cases = (("bf16 head", GEMV_CONFIG, "*bf16", False, True), ("int8 head words", INT8_GEMV_CONFIG, "*i8", True, True),
             ("int8 body words", INT8_GEMV_CONFIG, "*i8", True, False))
    for name, c, w, int8, head in cases:
        sig = {"x_ptr": "*bf16", "w_ptr": w, "s_ptr": "*fp32", "keep_ptr": "*i64", "pmax_ptr": "*fp32",
               "pidx_ptr": "*i32", "logit_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32",
               "stride_wn": "i32", "stride_lm": "i32", "softcap": "fp32"}
        ce = dict(K=2560, NUM_P=262144 // c.block_n, BLOCK_M=1, BLOCK_N=c.block_n, BLOCK_K=c.block_k, HAS_SCALE=int8,
                  HAS_KEEP=head, STORE_LOGITS=True, WANT_IDS=head, SOFTCAP=head, ROUND=True, IEEE=False, WORDS8=int8)
        # the launch specialises the strides of 16-element multiples (x's and w's rows, the logits' rows)
        ptx, regs, spills = build(_head_block_kernel, sig, ce, (0, 1, 2, 3, 4, 5, 6, 9, 10, 11), c.num_warps)
        loop = ptx[ptx.find("Inner Loop Header"):]
        loop = loop[:loop.find("bra")]
        print(f"head8\t{name}\t{regs}\t{spills}\t{len(re.findall(r'cvt[.]rn[.]f32[.]s', ptx))}\t"
              f"{loop.count('ld.global.v4')}\t{loop.count('bar.sync')}")


def accept_line():
    """kernels/spec_accept.py's accept at k = 7 under replay, one warp as launched ("accept" line: registers,
    spill bytes, barriers, the stores before the first barrier)."""
    from fastgemma.kernels.spec_accept import _accept_kernel

    names = ("t_ptr", "d_ptr", "rows_h_ptr", "out_ptr", "count_ptr", "tok_ptr", "hid_ptr", "pos_ptr", "hits_ptr",
             "tries_ptr", "n_log_ptr", "step_ptr", "stat_end_ptr", "ref_ptr", "ref_end_ptr", "mismatch_ptr")
    sig = {n: "*bf16" if n in ("rows_h_ptr", "hid_ptr") else "*i64" for n in names}
    sig.update({n: "i32" for n in ("B", "H", "out_stride", "log_stride", "ref_len")})
    ptx, regs, spills = build(_accept_kernel, sig, dict(K=7, KP=8, BH=1024, REPLAY=True), (), 1)
    first_bar = ptx.find("bar.sync")
    print(f"accept\taccept k=7 replay\t{regs}\t{spills}\t{ptx.count('bar.sync')}\t"
          f"{len(re.findall(r'st[.]global', ptx[:first_bar]))}")


def step_edge_lines():
    """kernels/step_start.py at E4B's sizes (hidden 2,560; RoPE halves 128 and 256; the PLE row 10,752) and E2B's
    (hidden 1,536, the PLE row 8,960) with the first norm and the table, kernels/step_advance.py at one row and
    kernels/gather_rows.py ("edge" lines: name, registers, spill bytes, the libdevice cos / sin calls' trace in the
    PTX: calls to __nv_ functions left unresolved, sin / cos.approx)."""
    import inspect

    from fastgemma.kernels.gather_rows import CHUNK, _gather_rows_kernel
    from fastgemma.kernels.step_advance import _step_advance_kernel
    from fastgemma.kernels.step_start import PLE_CHUNK, _step_start_kernel

    kinds = {"ids_ptr": "*i64", "pos_ptr": "*i64", "fs_ptr": "*fp32", "ff_ptr": "*fp32", "ring_pos_ptr": "*i32",
             "slot_ptr": "*i64", "scale": "fp32", "eps": "fp32", "off": "fp32", "ring": "i32"}
    # the kernel's runtime arguments in its order: other pointers are bf16 rows
    names = [n for n in inspect.signature(_step_start_kernel.fn).parameters if n.islower()]
    sig = {n: kinds.get(n, "*bf16") for n in names}
    for name, H, NP in (("E4B", 2560, 10752), ("E2B", 1536, 8960)):  # E2B: x's block (2,048) unlike a PLE chunk's
        ce = dict(H=H, BH=triton.next_power_of_2(H), NP=NP, CHUNK=PLE_CHUNK, HS=128, BS=128, HF=256, BF=256,
                  HAS_PRE=True, HAS_TABLE=True, INTERPRET=False)
        ptx, regs, spills = build(_step_start_kernel, sig, ce, [i for i, n in enumerate(names) if n.endswith("_ptr")],
                                  4)
        print(f"edge\tstep start {name}\t{regs}\t{spills}\t{ptx.count('call.uni')}\t"
              f"{len(re.findall(r'(sin|cos)[.]approx', ptx))}")
    sig = {"nxt_ptr": "*i64", "tok_ptr": "*i64", "pos_ptr": "*i64", "out_ptr": "*i64", "count_ptr": "*i64",
           "stride_out": "i32", "width": "i32"}
    ptx, regs, spills = build(_step_advance_kernel, sig, dict(B=1, BLOCK=2), [0, 1, 2, 3, 4], 1)
    print(f"edge\tstep advance\t{regs}\t{spills}\t{ptx.count('call.uni')}\t0")
    sig = {"w_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16", "D": "i32", "stride_w": "i32"}
    ptx, regs, spills = build(_gather_rows_kernel, sig, dict(CHUNK=CHUNK), [0, 1, 2], 4)
    print(f"edge\tgather rows\t{regs}\t{spills}\t{ptx.count('call.uni')}\t0")


def draft_loop_line():
    """The persistent draft loop on E4B's drafter ("loop" line: name, registers, spill bytes, release
    arrivals, acquire polls, GPU-scope atomics of any other kind)."""
    import inspect

    D, H, I, NH, HDS, HDF, C = 256, 2560, 2048, 4, 256, 512, 2048
    ce = dict(D=D, H=H, I=I, NH=NH, HKV=2, HD_S=HDS, HD_F=HDF, NL=4, KINDS=0b0111, C=C, CP=C, TOP_K=32, TPC=128,
              NSPL=32, BT_S=16, BT_F=8, BT_C=32, BN_PRE=2, BK_PRE=512, BN_Q=8, BN_O=2, BN_GU=32, BN_DN=2, BN_POST=32,
              BK_D=D, BK_I=512, BK_AS=512, BK_AF=512, BLOCK_D=32, KEY_SHIFT=16, SPIN=dl.SPIN_LIMIT,
              LSZ_S=dl.layer_size(D, NH, HDS, I), LSZ_F=dl.layer_size(D, NH, HDF, I), GSZ=dl.global_size(D, H, C))
    kinds = {"m_buf": "*fp32", "l_buf": "*fp32", "acc_buf": "*fp32", "pmax": "*fp32", "pord": "*i32", "ptok": "*i64",
             "drafts": "*i64", "bar_ptr": "*i32", "err_ptr": "*i32", "order": "*i64", "tok_ptr": "*i64",
             "qpos_ptr": "*i64", "ring": "*i32", "s_emb": "fp32", "eps": "fp32", "off": "fp32"}
    kinds.update({n: "i32" for n in ("S_s", "ss_s", "sh_s", "S_f", "ss_f", "sh_f", "window", "nsteps")})
    names = [n for n in inspect.signature(dl._draft_loop_kernel.fn).parameters if n not in ce]
    sig = {n: kinds.get(n, "*bf16") for n in names}
    # strides of 16 elements, as Triton specialises the cache's
    aligned = [i for i, n in enumerate(names) if sig[n].startswith("*") or n in ("ss_s", "sh_s", "ss_f", "sh_f")]
    ptx, regs, spills = build(dl._draft_loop_kernel, sig, ce, aligned, 4)
    other = len(re.findall(r"atom\.global\.gpu", ptx)) - ptx.count("atom.global.gpu.release.add")
    print(f"loop\tdraft loop E4B\t{regs}\t{spills}\t{ptx.count('atom.global.gpu.release.add')}\t"
          f"{ptx.count('ld.global.gpu.acquire')}\t{other}")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with the interpreter off")
    main()
