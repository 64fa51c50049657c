"""How close to its FLOP floor each way of computing the small CNNs' convolutions runs on this CPU.

The evidence behind docs/benchmarks.md's statement that a CNN evaluation of ``lenet5`` or
``cnn_bn`` stays above 2.5× its FLOP floor at one thread: the floor is the layer's FLOPs ÷ the
measured peak of a 1024³ float32 matmul on the same threads (as ``eval_speed.py``), each time the
best of 5. Rows:

- the first convolution (one channel, 5×5, 28×28 → 24×24, 6 or 10 filters, 256 rows, the
  pipeline's chunk): oneDNN (``F.conv2d``), channels-last, aten's unfold + GEMM path
  (``thnn_conv2d``), an explicit unfold + batched GEMM, and the 2×2 space-to-depth rewrite
  (a 3×3 convolution of 4 channels into 4·C outputs, whose 2×2 pool is a channel maximum),
  oneDNN followed by the pipeline's 2×2 maximum, and flockfl's one-kernel convolution + pool
  (``flockfl/engine/convkernel.py``, what the evaluation runs; left out without a C compiler);
- the same convolution with 200 filters on 16 rows (20 models' filters side by side: what a wide
  first convolution shared by per-client models would be), through oneDNN and as a GEMM on rows
  unfolded once (the unfold not timed);
- the second convolution (10 → 20 channels, 12×12) of 20 models on 16 rows: one grouped
  convolution, a loop over the models, and one model on 320 rows (alone, with the pipeline's
  2×2 maximum, and through flockfl's kernel).

Usage: python benchmarks/conv_floor.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time


def best(fn, repeat: int = 5) -> float:
    fn()
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def s2d_weight(w):
    """Filters of a k×k convolution rewritten for a 2×2 space-to-depth input: [4·C_out, 4·C_in, k', k']."""
    import torch

    co, ci, k, _ = w.shape
    kk = (k + 2) // 2
    out = w.new_zeros(2, 2, co, ci, 2, 2, kk, kk)
    for a in range(2):
        for b in range(2):
            for p in range(kk):
                for q in range(2):
                    for s in range(kk):
                        for r in range(2):
                            u, v = 2 * p + q - a, 2 * s + r - b
                            if 0 <= u < k and 0 <= v < k:
                                out[a, b, :, :, q, r, p, s] = w[:, :, u, v]
    return torch.as_tensor(out).reshape(4 * co, ci * 4, kk, kk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from flockfl.engine import convkernel
    from flockfl.engine.convplan import max2d

    torch.set_num_threads(args.threads)
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    peak = 2 * 1024**3 / best(lambda: a @ b)
    rows = []

    def row(what: str, flop: float, fn) -> None:
        rows.append((what, best(fn) * 1e3, flop / peak * 1e3))

    n = 256
    x = torch.randn(n, 1, 28, 28, generator=g)
    xc = x.contiguous(memory_format=torch.channels_last)
    for co in (6, 10):
        w, bias = torch.randn(co, 1, 5, 5, generator=g), torch.randn(co, generator=g)
        flop = 2 * n * co * 24 * 24 * 25
        row(f"conv1 1→{co}, 256 rows: oneDNN", flop, lambda: F.conv2d(x, w, bias))
        row(f"conv1 1→{co}, 256 rows: oneDNN channels-last", flop, lambda: F.conv2d(xc, w, bias))
        row(f"conv1 1→{co}, 256 rows: aten unfold+GEMM", flop, lambda: torch._C._nn.thnn_conv2d(x, w, (5, 5), bias, 1, 0))
        row(f"conv1 1→{co}, 256 rows: unfold + batched GEMM", flop,
            lambda: torch.baddbmm(bias.reshape(1, -1, 1), w.reshape(1, co, -1).expand(n, -1, -1), F.unfold(x, 5)))
        # the im2col matrix [rows·576, 25] from a strided view of the image (written out), then one GEMM;
        # and the GEMM alone on a ready matrix: what conv1 would cost if writing its im2col were free
        view = lambda: x.as_strided((n, 24, 24, 5, 5), (784, 28, 1, 28, 1)).reshape(n * 576, 25)  # noqa: E731
        wt = w.reshape(co, 25).T.contiguous()
        row(f"conv1 1→{co}, 256 rows: im2col by a strided view + GEMM", flop, lambda: torch.addmm(bias, view(), wt))
        ready = view().contiguous()
        row(f"conv1 1→{co}, 256 rows: the GEMM alone on a ready im2col", flop, lambda: torch.addmm(bias, ready, wt))
        wide = ready.T.contiguous()  # [25, rows·576]: the filters on the left, a short, wide product
        row(f"conv1 1→{co}, 256 rows: the GEMM alone, [{co}, 25] @ [25, rows·576]", flop, lambda: w.reshape(co, 25) @ wide)
        ws = s2d_weight(w)
        row(f"conv1 1→{co}, 256 rows: space-to-depth, pool as a channel max", flop,
            lambda: F.conv2d(F.pixel_unshuffle(x, 2), ws).view(n, 4, co, 12, 12).amax(1))
        # what the evaluation runs (flockfl/engine/convkernel.py): the convolution and its 2×2 pool in one
        # kernel, against the convolution's FLOPs alone; oneDNN's convolution then the pipeline's pool beside it
        row(f"conv1 1→{co}, 256 rows: oneDNN + the pipeline's 2×2 maximum", flop, lambda: max2d(F.conv2d(x, w, bias), (2, 2)))
        if convkernel.available():
            row(f"conv1 1→{co}, 256 rows: flockfl's conv + pool kernel", flop, lambda: convkernel.conv_pool(x, w, bias))
    r16 = torch.randn(16, 1, 28, 28, generator=g)
    w200, b200 = torch.randn(200, 1, 5, 5, generator=g), torch.randn(200, generator=g)
    flop = 2 * 16 * 200 * 24 * 24 * 25
    row("conv1 1→200 (20 models), 16 rows: oneDNN", flop, lambda: F.conv2d(r16, w200, b200))
    u = F.unfold(r16, 5).transpose(1, 2).reshape(-1, 25).contiguous()
    row("conv1 1→200 (20 models), 16 rows: GEMM on unfolded rows", flop, lambda: torch.addmm(b200, u, w200.reshape(200, -1).T))
    G, c1, c2, r = 20, 10, 20, 16
    xg = torch.randn(r, G * c1, 12, 12, generator=g)
    w2, b2 = torch.randn(G * c2, c1, 5, 5, generator=g), torch.randn(G * c2, generator=g)
    flop = 2 * r * G * c2 * 64 * c1 * 25
    row("conv2 10→20 of 20 models, 16 rows: grouped", flop, lambda: F.conv2d(xg, w2, b2, groups=G))
    parts = [xg[:, i * c1:(i + 1) * c1].contiguous() for i in range(G)]
    row("conv2 10→20 of 20 models, 16 rows: loop", flop,
        lambda: [F.conv2d(parts[i], w2[i * c2:(i + 1) * c2], b2[i * c2:(i + 1) * c2]) for i in range(G)])
    one = torch.randn(r * G, c1, 12, 12, generator=g)
    row("conv2 10→20 of one model, 320 rows", flop, lambda: F.conv2d(one, w2[:c2], b2[:c2]))
    row("conv2 10→20 of one model, 320 rows: oneDNN + the pipeline's 2×2 maximum", flop,
        lambda: max2d(F.conv2d(one, w2[:c2], b2[:c2]), (2, 2)))
    if convkernel.available():
        row("conv2 10→20 of one model, 320 rows: flockfl's conv + pool kernel", flop,
            lambda: convkernel.conv_pool(one, w2[:c2], b2[:c2]))

    print(f"threads={torch.get_num_threads()}  peak matmul {peak / 1e9:.1f} GFLOP/s (1024³ float32)  torch {torch.__version__}")
    print(f"{'convolution':<66}{'ms':>9}{'floor ms':>10}{'÷ floor':>9}")
    for what, ms, floor in rows:
        print(f"{what:<66}{ms:>9.2f}{floor:>10.2f}{ms / floor:>9.2f}")


if __name__ == "__main__":
    main()
