"""The MTP drafter's centroid-masked head on a GPU (not a test): torch's path against kernels/draft_head.py.

E4B's drafter (2,048 centroids of 128 tokens, hidden 256, top 32; synthetic weights with the exact
shapes): `Drafter.next_token` with its torch path (centroid GEMV, topk, the candidates' rows, their
scores, argmax: the fused drafter's head before) and with the two launches of kernels/draft_head.py
(`head_fn`, fuse=layers' default; plain, and as programmatic dependent launches as under fuse.pdl;
under PDL also with one select program a centroid instead of `CANDIDATE_SPLITS`),
each in a CUDA graph (median of repeats; the head's 3 MB stay in L2, as they do between the steps of
the draft loop). The ids of every path are checked against the kernel's twin on fresh random states
first. Run: python -m fastgemma.bench.draft_head [--rows 1]
"""
from __future__ import annotations

import argparse
import functools

import torch


def bench_draft_head(rows: int = 1, checks: int = 64, device: str = "cuda", model: str = "gemma4_e4b",
                     dtype=torch.bfloat16, timer=None) -> list[dict]:
    """Print a table; return one dict per path: us per call, ids equal to the twin's on `checks`
    random states (counted), the top-k size. `timer(fn) -> ms` defaults to triton's
    do_bench_cudagraph (tests pass their own, on a CPU with the tiny model)."""
    from ..kernels.draft_head import draft_head_op, draft_head_ref
    from ..model import preset
    from ..model.drafter import synthetic_drafter

    dev = torch.device(device)
    if timer is None:
        from triton.testing import do_bench_cudagraph

        if not torch.cuda.is_available():
            raise RuntimeError("bench_draft_head needs a CUDA device")
        timer = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median")  # noqa: E731
    d = synthetic_drafter(preset(model), dev, dtype, seed=0)
    me, w, c = d.masked_embedding, d.model.embed_tokens.weight, d.config
    args = (me.centroids.weight, me.token_ordering, w, d.top_k)
    gen = torch.Generator(device=dev).manual_seed(1)
    # the drafter's final-norm state has unit RMS: scores of the same spread as in the loop
    states = [torch.randn(rows, c.hidden_size, device=dev, dtype=dtype, generator=gen) for _ in range(checks)]
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print(f"{where}  drafter head: {c.num_centroids} centroids x {c.tokens_per_centroid} tokens, hidden "
          f"{c.hidden_size}, top {d.top_k}, {rows} row(s), {dtype}; CUDA graphs, head in L2")
    print(f"{'path':>30} | {'us':>8} | ids = twin")
    out = []
    for name, fn in (("torch (topk, gather, einsum)", None), ("kernels/draft_head.py", draft_head_op),
                     ("kernels/draft_head.py, PDL", functools.partial(draft_head_op, pdl=True)),
                     ("PDL, one select program a centroid", functools.partial(draft_head_op, pdl=True, splits=1))):
        d.head_fn = fn
        same = sum(int(torch.equal(d.next_token(g), draft_head_ref(g, *args))) for g in states)
        g0 = states[0]
        us = 1e3 * timer(lambda: d.next_token(g0))
        out.append(dict(path=name, us=us, ids_equal=same, checks=checks, rows=rows, top_k=d.top_k))
        print(f"{name:>30} | {us:8.2f} | {same}/{checks}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1, help="drafter states per call (1 in the draft loop)")
    ap.add_argument("--checks", type=int, default=64, help="random states whose ids are compared with the twin's")
    ap.add_argument("--model", default="gemma4_e4b")
    a = ap.parse_args(argv)
    bench_draft_head(a.rows, a.checks, model=a.model)


if __name__ == "__main__":
    main()
