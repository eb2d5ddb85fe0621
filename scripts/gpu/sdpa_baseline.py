#!/usr/bin/env python3
"""PyTorch's decode attention on the same shapes as kvcache_cuda_bench's BM_cuda_attend (f16 K/V,
8 KV heads x 128, 32 query heads, one query token), timed with CUDA events, as a fraction of the
device-to-device copy bandwidth measured in the same run. Run on a GPU machine that has torch:
    python3 scripts/gpu/sdpa_baseline.py
Prints one line per shape: K+V GB/s and the ratio to the copy bandwidth (read + write counted)."""
import statistics
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # not every GPU machine has torch
    print(f"sdpa_baseline: no torch: {e}")
    sys.exit(0)

if not torch.cuda.is_available():
    print("sdpa_baseline: no CUDA device")
    sys.exit(0)

dev = torch.device("cuda")
# Larger than L2: every launch reads HBM. Read before each launch (a reduction), not written: a
# write leaves L2 full of dirty lines, which the timed launch would write back (as kvcache_cuda_bench).
flush = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)


def timed(fn, reps=50, flush_l2=True):
    fn()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        if flush_l2:
            flush.max()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(times)


a = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_()
b = torch.empty_like(a)
copy_bw = max(2 * a.numel() / timed(lambda: b.copy_(a), reps=10, flush_l2=False) for _ in range(2))
del a, b
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: copy bandwidth (read + write) {copy_bw * 1e-9:.1f} GB/s")

for tokens in (4096, 32768):
    for batch in (1, 8):
        q = torch.randn(batch, 32, 1, 128, dtype=torch.float16, device=dev)
        k = torch.rand(batch, 8, tokens, 128, dtype=torch.float16, device=dev) * 2 - 1
        v = torch.rand(batch, 8, tokens, 128, dtype=torch.float16, device=dev) * 2 - 1
        kv_bytes = 2 * k.numel() * k.element_size()
        for name, fn in (
            ("sdpa(enable_gqa)", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
            ("sdpa(repeat_kv)", lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1))),
        ):
            try:
                t = timed(fn)
            except Exception as ex:  # a backend may refuse a shape
                print(f"tokens {tokens:6d} batch {batch}: {name}: failed: {ex}")
                continue
            bw = kv_bytes / t
            print(f"tokens {tokens:6d} batch {batch}: {name:18s} {t * 1e6:9.1f} us  {bw * 1e-9:7.1f} GB/s  "
                  f"of_d2d {bw / copy_bw:.3f}")
        del q, k, v
