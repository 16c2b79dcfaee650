"""torch's CPU random generator, bit for bit: ``Generator`` and ``permutation``, so a shuffle seeded
in minipar visits the samples in the order torch's does (DataLoader, DistributedSampler).

torch.Generator is a Mersenne Twister (Matsumoto & Nishimura 1998) seeded with the standard
``init_genrand``; NumPy's MT19937 bit generator takes the same 624-word state, so set to torch's
seeding it draws torch's 32-bit numbers. torch.randperm(n) (n < 2**32 / 20) is a Fisher-Yates
shuffle using one draw per position (aten's randperm_cpu).

    g = minipar.Generator().manual_seed(0)
    permutation(5, g)     # array([4, 1, 2, 0, 3]): torch.randperm(5, generator=...)'s too
"""
from . import backend, random


class Generator:
    """A seeded stream of 32-bit draws, torch.Generator's (``manual_seed``, ``initial_seed``)."""

    def __init__(self):
        self._bits = backend.numpy.random.MT19937()
        self.manual_seed(67280421310721)  # torch.Generator()'s default seed

    def manual_seed(self, seed):
        # mt19937's init_genrand (torch's at::mt19937 keeps the low 32 bits of the seed)
        self._seed, key = int(seed), [int(seed) & 0xFFFFFFFF]
        for i in range(1, 624):
            key.append((1812433253 * (key[-1] ^ (key[-1] >> 30)) + i) & 0xFFFFFFFF)
        self._bits.state = {"bit_generator": "MT19937",
                            "state": {"key": backend.numpy.array(key, "uint32"), "pos": 624}}
        return self

    def initial_seed(self):
        return self._seed

    def draws(self, n):
        """The next ``n`` 32-bit numbers of the stream (a host uint64 array)."""
        return self._bits.random_raw(n)


def permutation(n, generator=None):
    """A permutation of range(n) as torch.randperm draws it from ``generator`` (a fresh one,
    seeded from minipar's stream (``manual_seed``), if None), as a host int64 array."""
    if n < 0 or n >= 2**32 // 20:  # torch shuffles larger n with 64-bit draws: not reproduced
        raise ValueError(f"permutation: n must lie in [0, {2**32 // 20}), got {n}")
    if generator is None:
        generator = Generator().manual_seed(int(random.generator(backend.numpy).integers(2**63)))
    order = backend.numpy.arange(n)
    if n > 1:
        # position i swaps with one of the n - i places from i on, as aten's loop does
        picks = generator.draws(n - 1) % backend.numpy.arange(n, 1, -1, dtype="uint64")
        for i, z in enumerate(picks.tolist()):
            order[i], order[i + z] = order[i + z], order[i]
    return order
