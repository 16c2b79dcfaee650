"""Hardware profiles: what a GPU computes and holds, and what its links carry, as cost models.

A profile's links are ``comm.cost.Model``s (alpha, beta, gamma), so the planner prices a
collective with the library's own formula (``cost.predict``): one model inside a node (NVLink),
one across nodes (InfiniBand). ``here()`` is this machine: the cost model fitted by ``minipar
bench allreduce`` in this process (else ``MINIPAR_COST``, else cost.py's guess) and a GEMM rate
timed now with NumPy.

    h100 = PROFILES["h100"]
    h100.peak("bf16"), h100.link(inside_node=True)     # 989e12 FLOP/s; Model(alpha=3e-06, ...)
"""
import dataclasses
import os
import time

from minipar.comm import cost


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    peaks: dict          # precision -> dense FLOP/s (matrix units)
    memory: float        # HBM bytes per GPU
    hbm: float           # HBM bytes/s
    nvlink: float        # bytes/s one way, GPU to GPU inside a node
    internode: float     # bytes/s one way, per GPU, across nodes
    alpha_intra: float   # seconds per message step inside a node (an assumption, not a data sheet)
    alpha_inter: float   # ... across nodes
    efficiency: float = 0.5  # the share of peak the matmuls reach (the compute time's one guess)
    fitted: object = None    # ``here``: the cost.Model fitted on this machine, for every link

    def peak(self, precision):
        """Dense FLOP/s in ``precision``."""
        return self.peaks[precision]

    def link(self, inside_node):
        """The α-β-γ model of a link: beta = 1/bandwidth; gamma, a reduction on the GPU,
        streams 3 bytes through HBM per byte reduced (2 read, 1 written), as cost.py's guess."""
        if self.fitted is not None:
            return self.fitted
        bandwidth, alpha = ((self.nvlink, self.alpha_intra) if inside_node
                            else (self.internode, self.alpha_inter))
        return cost.Model(alpha, {1: 1 / bandwidth}, {1: 3 / self.hbm})


GB = 10**9
# NVLink data sheets print the two directions added: 900 GB/s (H100), 600 GB/s (A100) is
# 450 and 300 GB/s each way, and a ring sends one way while it receives the other. InfiniBand
# is one NIC per GPU (DGX H100: ConnectX-7 NDR 400 Gb/s = 50 GB/s; DGX A100: HDR 200 Gb/s =
# 25 GB/s), each way. The alphas are NCCL-like per-step latencies we assume: 3 µs over
# NVLink, 6 µs over InfiniBand (no data sheet prints them).
PROFILES = {
    # NVIDIA H100 Tensor Core GPU data sheet, SXM column: bf16/fp16 989 TFLOP/s dense
    # (1,979 with sparsity), FP32 67 TFLOP/s, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s
    "h100": Profile("H100 SXM 80GB", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                    80 * GB, 3.35e12, 450 * GB, 50 * GB, 3e-6, 6e-6),
    # NVIDIA A100 Tensor Core GPU data sheet, 80GB SXM column: bf16/fp16 312 TFLOP/s dense
    # (624 with sparsity), FP32 19.5 TFLOP/s, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s
    "a100": Profile("A100 SXM 80GB", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                    80 * GB, 2.039e12, 300 * GB, 25 * GB, 3e-6, 6e-6),
}


def gemm_rate(n=256, repeats=5):
    """FLOP/s of this machine's NumPy matmul, an n x n float32 product timed now (best of
    ``repeats``): 2n³ FLOPs each."""
    import numpy as np
    a = np.ones((n, n), np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def here():
    """This machine: ranks are processes on one node, so both links are the cost model
    ``comm.cost.default_model()`` gives; the peak is the measured GEMM rate, reached in full
    (efficiency 1: it was measured, not read off a sheet); memory is the host's RAM."""
    model = cost.default_model()
    rate = gemm_rate()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bandwidth = 1 / model.beta(1 << 20)  # shown in the table; the link is the model itself
    return Profile("here", {p: rate for p in ("fp32", "bf16", "fp16")}, ram,
                   3 / model.gamma(1 << 20), bandwidth, bandwidth, model.alpha, model.alpha,
                   efficiency=1.0, fitted=model)


def profile(name):
    """The named profile (``h100``, ``a100``), or ``here()``."""
    if name == "here":
        return here()
    if name not in PROFILES:
        raise KeyError(f"no hardware profile {name!r}; known: {', '.join(PROFILES)}, here")
    return PROFILES[name]
