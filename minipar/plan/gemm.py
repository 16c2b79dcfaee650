"""A GPU's matrix multiplications priced by their shape, its other kernels by their bytes.

A GEMM (batch x (m x k) @ (k x n)) runs as CTA tiles of tm x tn outputs, one per SM at a time,
in waves over the SMs; each tile steps through k in k-tiles at the tensor cores' sustained rate,
after a prologue that fills the pipeline's first stages and before an epilogue that writes its
outputs, both at the SM's share of the HBM bandwidth. The time is the best tile's, and never
less than the GEMM's bytes at the HBM bandwidth (the roofline). Every constant is a data sheet's
or a microbenchmark's (``Chip``, docs/plan.md), none fitted to the runs the tests check.

    gemm_seconds(PROFILES["a100"], "bf16", 1, 2048, 12288, 4608)    # a GEMM by its shape
    stream_seconds(PROFILES["a100"], 4 * 2048 * 12288)              # a kernel by its bytes
"""
import dataclasses
import functools
import math


@dataclasses.dataclass(frozen=True)
class Chip:
    """What prices a GEMM's shape on one GPU: its SMs, the CTA tiles cuBLAS picks among, the main
    loop's k-tile and stages, whether the kernels are persistent (Hopper's overlap one tile's
    epilogue with the next one's main loop: the fill and drain are paid once per SM), and the
    share of the data sheet's peak a saturated main loop sustains, by precision."""
    sms: int
    tiles: tuple
    k_tile: int
    stages: int
    persistent: bool
    sustained: dict = dataclasses.field(hash=False, compare=False)


# Bekman, "Machine Learning Engineering" (compute/accelerator, mamf-finder.py): the H200 (the
# H100's silicon and 700 W) sustains 755 of its 989 bf16 TFLOP/s once a long matmul has
# saturated it at its power limit (MSMF, "the one to use for training"), where short bursts reach
# 834 (MAMF); the A100's MAMF is 0.869 of peak, the H100's 0.803, and no MSMF is published for
# either: the saturated share 755/989 is taken for both. FP8 on the H100: MAMF 1402.6 of 1979,
# derated by the same saturation (755/834).
SATURATED = 755 / 989
FP8_SATURATED = 1402.6 / 1979 * 755 / 834
# cuBLAS's kernel names carry their tiles, k-tile and stages: on the A100
# ampere_fp16_s16816gemm_fp16_256x128_ldg8_f2f_stages_64x3_tn and its 128x256, 128x128, 128x64
# and 64x64 kin; on the H100 sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64
# (persistent, warp-specialised) and its 256x128, 128x128, 128x64 kin. SM counts: the A100
# and H100 architecture whitepapers (108 and 132 SMs enabled)
AMPERE = Chip(108, ((256, 128), (128, 256), (128, 128), (128, 64), (64, 64)), 64, 3, False,
              {"bf16": SATURATED, "fp16": SATURATED, "fp32": SATURATED})
HOPPER = Chip(132, ((128, 256), (256, 128), (128, 128), (128, 64), (64, 64)), 64, 4, True,
              {"bf16": SATURATED, "fp16": SATURATED, "fp32": SATURATED, "fp8": FP8_SATURATED})
# bytes an element of each GEMM's operands and output: 16-bit in and out; FP8 reads one byte
# and writes bf16 (torchao's and Transformer Engine's scaled_mm); fp32 runs on TF32 cores
WIDTH = {"bf16": (2, 2), "fp16": (2, 2), "fp32": (4, 4), "fp8": (1, 2)}


def rates(profile, precision):
    """(FLOP/s, HBM bytes/s) of one SM: the sustained share of the peak, the bandwidth's share."""
    chip = profile.chip
    return (profile.peak(precision) * chip.sustained[precision] / chip.sms,
            profile.hbm / chip.sms)


def tile_seconds(chip, widths, rate, batch, m, k, n, tile):
    """Seconds of the GEMM run as ``tile`` = (tm, tn): its waves of tiles over the SMs, each
    tile's main loop over k plus (per tile, or once per SM when persistent) the prologue's
    first stages in and the epilogue's outputs out at the SM's share of the HBM bandwidth;
    ``rate`` is one SM's (FLOP/s, bytes/s)."""
    (tm, tn), (w_in, w_out), (flops, nbytes) = tile, widths, rate
    step = 2 * tm * tn * chip.k_tile / flops
    fill = (chip.stages - 1) * (tm + tn) * chip.k_tile * w_in / nbytes
    drain = tm * tn * w_out / nbytes
    waves = math.ceil(batch * math.ceil(m / tm) * math.ceil(n / tn) / chip.sms)
    loop = math.ceil(k / chip.k_tile) * step
    if chip.persistent:  # the next tile's main loop hides this one's epilogue
        return waves * loop + fill + drain
    return waves * (loop + fill + drain)


def gemm_seconds(profile, precision, batch, m, k, n):
    """Seconds of ``batch`` (m x k) @ (k x n) products on ``profile``'s GPU: the best tile's
    (``tile_seconds``), and at least the operands and the output once through HBM."""
    return _gemm(profile.chip, WIDTH[precision], rates(profile, precision), profile.hbm,
                 batch, m, k, n)


@functools.lru_cache(maxsize=1 << 16)
def _gemm(chip, widths, rate, hbm, batch, m, k, n):
    w_in, w_out = widths
    compute = min(tile_seconds(chip, widths, rate, batch, m, k, n, t) for t in chip.tiles)
    return max(compute, batch * ((m * k + k * n) * w_in + m * n * w_out) / hbm)


def gemms_seconds(profile, precision, gemms):
    """Forward and backward of the products ``gemms`` [(batch, m, k, n)]: the forward, then
    dX (m, n, k) and dW (k, m, n), each a GEMM of its own shape (a batched product's dW stays
    batched: attention's per-head products)."""
    total = 0.0
    for b, m, k, n in gemms:
        weight = (1, k, b * m, n) if b == 1 else (b, k, m, n)
        total += (gemm_seconds(profile, precision, b, m, k, n)
                  + gemm_seconds(profile, precision, b, m, n, k)
                  + gemm_seconds(profile, precision, *weight))
    return total


def forward_seconds(profile, precision, gemms):
    """The forward products of ``gemms`` alone (a recomputed forward)."""
    return sum(gemm_seconds(profile, precision, *g) for g in gemms)


def stream_seconds(profile, nbytes):
    """Seconds to stream ``nbytes`` through HBM (read and written counted both) at the data
    sheet's bandwidth: an element-wise kernel's time."""
    return nbytes / profile.hbm
