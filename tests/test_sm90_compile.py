"""GPU-only kernel variants compile for sm_90a here (no GPU needed): PDL launches and every
fused-GEMV prologue / epilogue (dense and int4), without register spills, with the PDL wait after
the dense kernels' weight loads and before the int4 kernel's first load."""
import os
import subprocess
import sys
from pathlib import Path


def test_gpu_only_variants_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split("\t")[0]: [int(x) for x in line.split("\t")[1:]] for line in r.stdout.splitlines() if "\t" in line}
    assert len(rows) == 11, r.stdout
    for name, (regs, spills, waits, loads_before_wait, k_blocks) in rows.items():
        assert spills == 0 and regs <= 255, (name, regs, spills)
        assert waits == 1, name
        # dense: every weight block is loaded before the wait (>= one vector load per block);
        # int4: nothing is loaded before it
        assert loads_before_wait >= k_blocks if k_blocks else loads_before_wait == 0, (name, loads_before_wait)
