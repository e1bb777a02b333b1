"""GPU-only kernel variants compile for sm_90a here (no GPU needed): PDL launches and every
fused-GEMV prologue / epilogue, without register spills, with the PDL wait after the weight loads."""
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
    assert len(rows) == 7, r.stdout
    for name, (regs, spills, waits, loads_before_wait, k_blocks) in rows.items():
        assert spills == 0 and regs <= 255, (name, regs, spills)
        assert waits == 1, name
        # every weight block is loaded before the wait (>= one vector load per block)
        assert loads_before_wait >= k_blocks, (name, loads_before_wait, k_blocks)
