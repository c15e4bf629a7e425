"""Time the NF4 matmul's tile configurations on this GPU at a decode step's width, for the
weight shapes of Llama 3.1 8B: `python -m specchat.models.cuda.sweep`. Prints the achieved
read bandwidth of each (codes, absmax and activations once), best first per shape; the rule
`kernels.nf4_block_n` is chosen from such a table, never at run time (a row's bits must not
depend on a timing)."""

from __future__ import annotations

import itertools
import statistics

import torch

from specchat.models.cuda import kernels

SHAPES = {"qkv": (4096, 4096), "kv": (1024, 4096), "gate/up": (14336, 4096),
          "down": (4096, 14336)}  # (out features, in features)
CONFIGS = list(itertools.product((16, 32, 64), (2, 4, 8), (2, 3, 4)))


def _time_ms(fn, repeats: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    device = torch.device("cuda")
    table = kernels.pair_table(torch.linspace(-1, 1, 16)).to(device)
    print(f"{torch.cuda.get_device_name(device)}: NF4 matmul, {kernels.ROWS} rows, "
          "GB/s read (default config marked *)")
    for name, (n, k) in SHAPES.items():
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        absmax = torch.rand(n, k // 64, device=device)
        x = torch.randn(kernels.ROWS, k, dtype=torch.bfloat16, device=device)
        read = packed.numel() + absmax.numel() * 4 + x.numel() * 2
        default = (kernels.nf4_block_n(n, k), 4, 4)
        rows = []
        for config in CONFIGS:
            try:
                ms = _time_ms(lambda c=config: kernels.nf4_matmul(x, packed, absmax, table,
                                                                   config=c))
            except Exception as e:  # a tile that does not fit this GPU
                print(f"  {name} {config}: {type(e).__name__}")
                continue
            rows.append((read / ms / 1e6, config, ms))
        rows.sort(reverse=True)
        for gbs, config, ms in rows[:5] + [r for r in rows if r[1] == default]:
            mark = "*" if config == default else " "
            print(f"  {name:8} {n}x{k} block_n {config[0]:3} warps {config[1]} stages "
                  f"{config[2]}{mark} {ms * 1000:8.1f} us {gbs:7.0f} GB/s")


if __name__ == "__main__":
    main()
