"""The GPUs the planner prices, from their data sheets: peaks, memory, links, and the chip that
prices a GEMM's shape (``gemm.Chip``). ``hardware.here()`` builds this machine's profile.

    h100 = PROFILES["h100"]
    h100.peak("bf16"), h100.peak("fp8"), h100.link(inside_node=True)
    PROFILES["a100"].peak("fp8")        # ValueError: the A100's data sheet has no FP8
"""
import dataclasses

from minipar.comm import cost

from .gemm import AMPERE, HOPPER


@dataclasses.dataclass(frozen=True, eq=False)  # hashed as itself: the planner caches by it
class Profile:
    name: str
    peaks: dict          # precision -> dense FLOP/s (matrix units)
    memory: float        # HBM bytes per GPU
    hbm: float           # HBM bytes/s
    nvlink: float        # bytes/s one way, GPU to GPU inside a node
    internode: float     # bytes/s one way, per GPU, across nodes
    alpha_intra: float   # seconds per message step inside a node (an assumption, not a data sheet)
    alpha_inter: float   # ... across nodes
    efficiency: float = 0.5  # ``here`` only: the share of peak its GEMMs reach (1: measured)
    fitted: object = None    # ``here``: the cost.Model fitted on this machine, for every link
    engine: object = None    # ``here``: minipar's own costs measured now (``Engine``); None:
    #                          a GPU, whose compute is priced by ``chip``
    sync: float = 0.0        # seconds each collective waits beyond its formula when the ranks
    #                          come to it from computing (``sync_seconds``, measured on the ranks
    #                          by scripts/bench_plan.py); 0: the ranks arrive together
    chip: object = None      # a GPU's SMs, tiles and sustained share (``gemm.Chip``)

    def peak(self, precision):
        """Dense FLOP/s in ``precision``; a precision the data sheet gives no peak for is a
        ValueError naming the GPU."""
        if precision not in self.peaks:
            raise ValueError(f"--precision {precision}: {self.name} has no {precision} matrix "
                             f"units on its data sheet (it lists {', '.join(self.peaks)})")
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
    # NVIDIA H100 Tensor Core GPU data sheet, SXM column: FP8 1,979 and bf16/fp16 989
    # TFLOP/s dense (twice that with sparsity), FP32 67 TFLOP/s (TF32 cores: 494.5), 80 GB
    # HBM3 at 3.35 TB/s, NVLink 900 GB/s
    "h100": Profile("H100 SXM 80GB", {"fp8": 1979e12, "bf16": 989e12, "fp16": 989e12,
                                      "fp32": 67e12}, 80 * GB, 3.35e12, 450 * GB, 50 * GB,
                    3e-6, 6e-6, chip=HOPPER),
    # NVIDIA A100 Tensor Core GPU data sheet, 80GB SXM column: bf16/fp16 312 TFLOP/s dense
    # (624 with sparsity), FP32 19.5 TFLOP/s, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s;
    # no FP8
    "a100": Profile("A100 SXM 80GB", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                    80 * GB, 2.039e12, 300 * GB, 25 * GB, 3e-6, 6e-6, chip=AMPERE),
}
