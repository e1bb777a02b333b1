"""kernels/l2_prefetch.py and bench.l2_ahead: the side-stream prefetch is a hint (nothing to do off
sm_90 CUDA, bad chunks refused), the plans' text, and the benchmark's layers under the interpreter
with a stub timer (every plan's outputs equal the first's)."""
import os

import pytest
import torch

from fastgemma.bench.l2_ahead import PHASES, bench_plans, main, parse_plan, table
from fastgemma.kernels.l2_prefetch import Ahead, l2_prefetch, prefetch_supported

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_prefetch_is_a_no_op_off_sm90_and_checks_its_arguments():
    t = torch.arange(1000, dtype=torch.int32)
    assert not prefetch_supported("cpu")
    assert l2_prefetch([t, t[:3]]) == 0
    for bad in (dict(chunk=8), dict(chunk=100), dict(lanes=3)):
        with pytest.raises(ValueError, match="l2_prefetch"):
            l2_prefetch([t], **bad)
    a = Ahead("cpu")
    a.fork([t])  # nothing queued, nothing to join
    a.join()
    assert not a.on and not a.forked


def test_plan_text():
    assert parse_plan("none") == {}
    assert parse_plan("down@gu,qkv+1@down,o+1@down") == {"gu": [("down", 0)], "down": [("qkv", 1), ("o", 1)]}
    for bad in ("down", "down@x", "mlp@gu", "down+2@gu", ""):
        with pytest.raises(ValueError, match="TARGET"):
            parse_plan(bad)


def test_main_refuses_bad_plans(capsys):
    with pytest.raises(SystemExit):
        main(["--plans", "none", "gu@mlp"])
    assert "--plans: plan entry 'gu@mlp'" in capsys.readouterr().err


@pytest.mark.skipif(not INTERPRET, reason="the kernels run under TRITON_INTERPRET=1 on a CPU")
def test_bench_plans_on_tiny_layers():
    shapes = {"qkv": (48, 256), "o": (64, 128), "gu": (64, 128), "down": (64, 256)}
    calls = []
    rows = bench_plans(["none", "down@gu,qkv+1@down"], layers=2, device="cpu", shapes=shapes,
                       timer=lambda fn: (fn(), calls.append(1), 8.0)[2])
    assert [r["plan"] for r in rows] == ["none", "down@gu,qkv+1@down"] and len(calls) == 2
    assert all(r["us_layer"] == 4.0 and not r["prefetch"] and set(r["configs"]) == set(PHASES) for r in rows)
    mb = sum(N * K // 2 + N * K // 128 * 4 for N, K in shapes.values()) / 1e6  # codes + bf16 scale / zero pairs
    assert rows[0]["mb_layer"] == pytest.approx(mb)
    assert "| down@gu,qkv+1@down | " in table(rows) and "+0.00" in table(rows)
    assert table([dict(plan="none", mb_layer=48.74, us_layer=25.51)]).splitlines()[-1] == \
        "| none | 48.74 | 25.51 | +0.00 | 1.91 |"  # MB a layer / us a layer: TB/s
