"""The CUDA W4A16 kernel (kernels/cuda/w4_gemm.cu) compiled for sm_90a without a GPU (NVRTC, tests/nvrtc_sass.py),
its SASS checked: the PDL order (a trigger first, the weights' copies before the wait, every load of x after
it: runs JL-JN found the kernel reading x early through a non-coherent load that ptxas had moved above the wait,
run JO the fix), no local memory, the mma count of its K slice, and the cluster barriers where K is split; the same
for the norm fold's consumer (w4_fold_kernel). The probe's diagnostic kernel (sweeps/probes/w4_geglu.cu) still
builds on the package's helpers."""
from pathlib import Path

import pytest

from fastgemma.kernels import cuda_gemm
from fastgemma.kernels.mma_table import INVARIANT_CONFIGS, MMA_CONFIGS
from nvrtc_sass import instructions, sass

ROOT = Path(__file__).resolve().parents[1]
SOURCE = cuda_gemm.SOURCE.read_text()

# (warps, stages, K slice, cluster, epilogue): the shipped gate|up, and the plain-store K splits of runs JL / JO
VARIANTS = [(5, 8, 2560, 1, 1), (4, 10, 1280, 8, 0), (5, 16, 512, 5, 0), (4, 8, 512, 4, 0)]


# the norm fold's consumer (w4_fold_kernel, K whole in a CTA): gate|up's GeGLU, q|k|v's plain store
FOLD_VARIANTS = [(5, 8, 2560, 1, 1, "fold"), (5, 16, 2560, 1, 0, "fold")]


def one_row_trigger(s, ks):
    """The source's FG_TRIG1 default: the groups a warp sums at one row before the dependents may launch (once its
    last group is asked for; after the first where the ring holds them all from the start)."""
    return ks // 128 - s if ks // 128 > s else 1


def kernel_sass(nw, s, ks, c, epi, kind="rows"):
    """kind: 'rows' (the plain kernel as several rows launch it: TRIG 0), 'one' (one row: TRIG FG_TRIG1), 'fold'."""
    name = (f"w4_fold_kernel<{nw}, {s}, {ks}, {epi}>" if kind == "fold" else
            f"w4_gemm_kernel<{nw}, {s}, {ks}, {c}, {epi}, {0 if kind == 'rows' else one_row_trigger(s, ks)}>")
    return instructions(sass(SOURCE, name))


CASES = [(*v, kind) for v in VARIANTS for kind in ("rows", "one")] + FOLD_VARIANTS


@pytest.mark.parametrize("variant", CASES, ids=lambda v: cuda_gemm.variant(*v[:5]) + "_" + v[5])
def test_sass_keeps_the_pdl_order_and_no_local_memory(variant):
    nw, s, ks, c, epi, kind = variant
    ins = kernel_sass(*variant)
    # opcodes, the never-executed ones (`@!PT`: ptxas' padding) left out
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in ins if not i.startswith("@!PT ")]
    # griddepcontrol.wait / launch_dependents: the plain kernel triggers at its start for several rows (run LU), for
    # one once a warp has asked for its last group and again, every thread, after its main loop (run NG); the fold's
    # consumer at its start
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == (2 if kind == "one" else 1)
    wait = ops.index("ACQBULK")
    trig = [i for i, o in enumerate(ops) if o == "PREEXIT"]
    mma = [i for i, o in enumerate(ops) if o.startswith("HMMA.")]
    if kind == "one":
        copies = [i for i, o in enumerate(ops) if o.startswith("LDGSTS")]
        # the first after the group's copies and the sums of `one_row_trigger` groups, the second after every mma
        assert wait < trig[0] and copies[-1] < trig[0] and trig[1] > mma[-1], (trig, copies[-1], mma[-1])
        assert sum(i < trig[0] for i in mma) == one_row_trigger(s, ks) * 8
    else:
        assert trig[0] < wait
    before = ops[:wait]
    # before the wait only the weights' copies into the ring: no global load at all (x comes after)
    loads = [o for o in before if o.startswith(("LDG.", "LD.", "LDS.")) or o == "LDS"]  # not LDGSTS, LDGDEPBAR
    assert not loads, f"loads before griddepcontrol.wait: {loads}"
    assert sum(o.startswith("LDGSTS") for o in before) == 3 * min(s, ks // 128)  # 2 word blocks + scales a group
    # x (and the fold's partials, a, y, post, scalar): coherent loads; the plain kernel's all 16-byte x loads
    assert all(".STRONG." in o for o in ops if o.startswith("LDG."))
    assert kind == "fold" or all(o.startswith("LDG.E.128.STRONG") for o in ops if o.startswith("LDG."))
    assert not [o for o in ops if o.startswith(("STL", "LDL"))], "local memory (spills)"
    # every shuffle a plain one: a loop of per-thread trip counts before them made ptxas emulate them as collectives
    # (WARPSYNC.COLLECTIVE; the fold consumer 2.4x slower, run JQ)
    assert "WARPSYNC.COLLECTIVE" not in ops and "ENDCOLLECTIVE" not in ops
    assert ops.count("HMMA.16816.F32.BF16") == ks // 128 * 8  # 2 blocks x 4 k steps a group
    # K split: two cluster barriers (partials in, then kept until read); none without a cluster
    assert ops.count("UCGABAR_ARV") == ops.count("UCGABAR_WAIT") == (2 if c > 1 else 0)


def test_shipped_cuda_entries_are_among_the_checked_variants():
    entries = [(N, K, cfg) for (N, K, *_), cfg in [*MMA_CONFIGS.items(), *INVARIANT_CONFIGS.items()] if cfg.cuda]
    assert entries and cuda_gemm.variants_of(entries) <= set(VARIANTS)


def test_probe_diagnostic_kernel_builds_on_the_package_helpers():
    probe = (ROOT / "sweeps" / "probes" / "w4_geglu.cu").read_text()
    for xg in ("false", "true"):  # x staged in shared memory, x from global
        name = f"w4_geglu_diag_kernel<5, 8, 2560, {xg}, false, 0>"
        ins = instructions(sass(SOURCE + probe, name))
        assert any(i.startswith("HMMA") for i in ins)


def test_cluster_phase_probe_builds_with_its_barriers():
    """sweeps/probes/cluster_phases.cu: a chain's phases inside one cluster, each opened by a cluster barrier
    (arrive before the loop and at each phase's end, wait at each phase's start and before exit), no local memory;
    its host helpers refuse what a cluster cannot take."""
    import importlib.util

    src = (ROOT / "sweeps" / "probes" / "cluster_phases.cu").read_text()
    for work in ("true", "false"):
        ops = [i.split()[0] for i in instructions(sass(src, f"cluster_chain<512, {work}>")) if not i.startswith("@")]
        assert ops.count("UCGABAR_ARV") == 2 and ops.count("UCGABAR_WAIT") == 2
        assert not [o for o in ops if o.startswith(("STL", "LDL"))]
    spec = importlib.util.spec_from_file_location("cluster_phases", ROOT / "sweeps" / "probes" / "cluster_phases.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.parse_shape("256/4096") == ([256, 4096], True) and probe.parse_shape("256:0") == ([256], False)
    assert probe.chain_dims([256, 4096], 3) == [256, 4096, 256, 4096]
    assert probe.problem([256, 4096], 16) is None  # 128 KB of weights a CTA
    assert "227 KB" in probe.problem([256, 4096], 4) and "whole shares" in probe.problem([200], 16)
    assert probe.problem([2560], 8) and probe.problem([2560], 8, work=False) is None  # the boundary alone holds none
