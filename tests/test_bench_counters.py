"""bench.counters (Nsight Compute over the int4 kernels) on a machine without ncu or a GPU: the
plan of launches, the parser on a real ncu report's text, the table, and the refusals."""
import pytest

from fastgemma.bench import counters

# two launches of an ncu 2025.3 report (H200, this benchmark's metrics), trimmed to a few lines each
REPORT = """==PROF== Connected to process 691 (/usr/bin/python3.12)
[691] python3.12@127.0.0.1
  _fused_w4a16_kernel (1280, 1, 1)x(64, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    --------------------------------------------------------------------------- --------------- ------------
    Metric Name                                                                     Metric Unit Metric Value
    --------------------------------------------------------------------------- --------------- ------------
    dram__throughput.avg.pct_of_peak_sustained_elapsed                                        %        31.84
    gpu__time_duration.sum                                                                   us        18.30
    l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum                                                     145,277
    launch__registers_per_thread                                                register/thread           96
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio               inst         2.80
    smsp__average_warps_issue_stalled_selected_per_issue_active.ratio                      inst            1
    smsp__inst_executed.sum                                                                inst    9,416,288
    smsp__issue_active.avg.pct_of_peak_sustained_active                                       %        56.89
    --------------------------------------------------------------------------- --------------- ------------

  _group_mma_kernel (40, 8, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    dram__throughput.avg.pct_of_peak_sustained_elapsed                                        %        21.39
    gpu__time_duration.sum                                                                   us        13.73
    smsp__inst_executed.sum                                                                inst    4,305,680
"""


def test_parse_reads_every_launch_and_metric():
    rows = counters.parse(REPORT)
    assert [(r["kernel"], r["grid"], r["block"]) for r in rows] == [
        ("_fused_w4a16_kernel", "1280,1,1", "64,1,1"), ("_group_mma_kernel", "40,8,1", "128,1,1")]
    assert rows[0]["gpu__time_duration.sum"] == 18.30 and rows[0]["smsp__inst_executed.sum"] == 9416288
    assert rows[0]["launch__registers_per_thread"] == 96
    assert rows[0]["l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"] == 145277  # a unit-less count
    assert rows[0]["smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"] == 2.80
    assert rows[1]["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == 21.39


def test_table_labels_launches_in_order_with_instructions_per_weight():
    rows = counters.parse(REPORT)
    launches = counters.plan([1, 8], ["gate|up", "down"])
    assert launches == [("gate|up", 1), ("down", 1), ("gate|up", 8), ("down", 8)]
    txt = counters.table(rows, [launches[0], launches[3]])
    lines = txt.splitlines()
    assert lines[0].startswith("| shape | rows | kernel |") and len(lines) == 4
    # gate|up at one row: 9,416,288 warp instructions x 32 over 20480 x 2560 weights = 5.75
    assert "| gate|up | 1 | _fused_w4a16_kernel | 1280,1,1 x 64,1,1 | 18.30 |" in lines[2] and "| 5.75 |" in lines[2]
    assert "| down | 8 | _group_mma_kernel |" in lines[3] and "| 5.26 |" in lines[3]  # 4,305,680 x 32 / 2560 / 10240
    with pytest.raises(ValueError, match="profiled 2 launches, 4 were planned"):
        counters.table(rows, launches)


def test_refusals(monkeypatch):
    with pytest.raises(SystemExit, match="unknown at 8 row"):
        counters.plan([8], ["gate|up", "W_q"])
    with pytest.raises(SystemExit, match="rows from 1 to 16"):
        counters.plan([32], None)
    monkeypatch.setattr(counters.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="needs Nsight Compute's `ncu`"):
        counters.main(["--ms", "1", "--shapes", "down"])
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            counters.main(["--launch", "--ms", "8", "--shapes", "down"])
    assert len(counters.metric_names()) == len(counters.METRICS) + len(counters.STALLS)
