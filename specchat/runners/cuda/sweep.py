"""Time the matmul kernels' tile configurations on this GPU at a decode step's width, for the
weight shapes of Llama 3.1 8B: `python -m specchat.runners.cuda.sweep`. Prints the read
bandwidth each achieves (weights, absmax and activations once), best first per shape, beside
the configuration the runtime takes. The runtime's rules (`kernels.nf4_config`, the default of
`kernels.matmul`) come from such tables, never from timings at run time: a row's bits must not
depend on a timing."""

from __future__ import annotations

import statistics

import torch

from specchat.runners.cuda import kernels

NF4_SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096),
              "down": (4096, 14336)}  # (out features, in features)
NF4_CONFIGS = [(16, 2, 4), (16, 2, 3), (16, 4, 2), (16, 4, 4), (32, 2, 3), (32, 4, 3),
               (64, 2, 3), (64, 4, 3)]
HEAD_SHAPES = {"lm head 8B": (128256, 4096), "lm head 1B": (128256, 2048)}
HEAD_CONFIGS = [(64, 128, 4, 3), (32, 128, 4, 4), (128, 128, 8, 3)]


def _time_ms(fn, repeats: int = 30) -> float:
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


def _report(name: str, shape: str, read: int, runs: list, default) -> None:
    rows = sorted(((read / ms / 1e6, config, ms) for config, ms in runs), reverse=True)
    for gbs, config, ms in rows[:4] + [r for r in rows[4:] if r[1] == default]:
        mark = "*" if config == default else " "
        print(f"  {name:10} {shape:12} {str(config):22}{mark} {ms * 1000:8.1f} us "
              f"{gbs:6.0f} GB/s")


def _sweep(fn, configs) -> list:
    runs = []
    for config in configs:
        try:
            runs.append((config, _time_ms(lambda c=config: fn(c))))
        except Exception as e:  # a tile that does not fit this GPU
            print(f"  {config}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    return runs


def main() -> None:
    device = torch.device("cuda")
    table = kernels.pair_table(torch.linspace(-1, 1, 16)).to(device)
    print(f"{torch.cuda.get_device_name(device)}: {kernels.ROWS} rows; NF4 configs (columns, "
          "warps, stages), bf16 (columns, K, warps, stages); the runtime's own marked *")
    for name, (n, k) in NF4_SHAPES.items():
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        absmax = torch.rand(n, k // 64, device=device)
        x = torch.randn(kernels.ROWS, k, dtype=torch.bfloat16, device=device)
        default = kernels.nf4_config(n, k)
        configs = NF4_CONFIGS + ([default] if default not in NF4_CONFIGS else [])
        runs = _sweep(lambda c: kernels.nf4_matmul(x, packed, absmax, table, config=c), configs)
        read = packed.numel() + absmax.numel() * 4 + x.numel() * 2
        _report(name, f"{n}x{k}", read, runs, default)
    for name, (n, k) in HEAD_SHAPES.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16, device=device)
        x = torch.randn(kernels.ROWS, k, dtype=torch.bfloat16, device=device)
        runs = _sweep(lambda c: kernels.matmul(x, weight, config=c), HEAD_CONFIGS)
        _report(name, f"{n}x{k}", weight.numel() * 2, runs, kernels.MATMUL_CONFIG)


if __name__ == "__main__":
    main()
