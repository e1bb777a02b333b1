"""Decode attention on the GPU: the Triton kernel vs its torch twin in bf16 (error) and time, at
E4B shapes: sliding ring (D=256, S=window+16) and full layers (D=512) at several live contexts."""
from __future__ import annotations

import torch
import triton.testing

from ..kernels.decode_attention import decode_attention, decode_attention_ref


def case(T, D, S, ctx, ring, window, splits=None):
    dev = "cuda"
    B, H, Hkv = 1, 8, 2
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16)
    q_pos = torch.arange(ctx - T, ctx, device=dev)[None]
    if ring:
        p = torch.arange(ctx - S, ctx, device=dev)
        slot_pos = torch.full((B, S), -1, dtype=torch.int32, device=dev)
        slot_pos[0, p[p >= 0] % S] = p[p >= 0].int()
    else:
        slot_pos = None
    ref = decode_attention_ref(q, k, v, q_pos, slot_pos, window)
    out = decode_attention(q, k, v, q_pos, slot_pos, window, num_splits=splits)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    fn = lambda: decode_attention(q, k, v, q_pos, slot_pos, window, num_splits=splits)  # noqa: E731
    fn()
    us = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
    return err, us


def main():
    print("| layer | T | ctx | splits | rel err vs twin | us |")
    print("|---|---|---|---|---|---|")
    for T in (1, 8):
        for splits in (None, 1, 4):
            err, us = case(T, 256, 528, 800, True, 512, splits)
            print(f"| sliding D=256 S=528 | {T} | 800 | {splits or 'auto'} | {err:.2e} | {us:.1f} |")
        for ctx in (300, 4096, 32768):
            for splits in (None, 8, 32):
                err, us = case(T, 512, 32784, ctx, False, 0, splits)
                print(f"| full D=512 S=32784 | {T} | {ctx} | {splits or 'auto'} | {err:.2e} | {us:.1f} |")


if __name__ == "__main__":
    main()
