"""The basic layers, each a thin Module over one function of ``minipar.functional``."""
import warnings

from .. import backend, functional as F
from ..autograd import Tensor, embedding
from . import init
from .module import Module, Parameter


class Linear(Module):
    """y = x Wᵀ + b, W of shape (out_features, in_features); PyTorch's U(±1/√in) init."""

    def __init__(self, in_features, out_features, bias=True, dtype="float32"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = init.fan_in_bound(in_features)
        self.weight = Parameter(init.uniform((out_features, in_features), bound, dtype))
        self.bias = Parameter(init.uniform((out_features,), bound, dtype)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table: row ``i`` of ``weight`` (num_embeddings, embedding_dim) is token i's
    vector; N(0, 1) init as in PyTorch."""

    def __init__(self, num_embeddings, embedding_dim, dtype="float32"):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(init.normal((num_embeddings, embedding_dim), 1.0, dtype))

    def forward(self, ids):
        return embedding(self.weight, ids)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Normalise each vector over its last axis, then scale by ``weight`` and shift by ``bias``."""

    def __init__(self, normalized_shape, eps=1e-5, bias=True, dtype="float32"):
        super().__init__()
        self.normalized_shape, self.eps = normalized_shape, eps
        self.weight = Parameter(init.ones((normalized_shape,), dtype))
        self.bias = Parameter(init.zeros((normalized_shape,), dtype)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


class Dropout(Module):
    """Inverted dropout while training (mask from ``minipar.random``); identity in eval mode."""

    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}"


class Dropout2d(Module):
    """Channel dropout (Tompson et al. 2015): while training each whole channel ``x[n, c]`` of an
    (N, C, H, W) input is zeroed with probability p, the others scaled by 1/(1−p); identity in
    eval mode. torch's arguments; ``inplace=True`` is refused as F.dropout refuses it."""

    def __init__(self, p=0.5, inplace=False):
        super().__init__()
        F.dropout(Tensor([1.0]), p, training=False, inplace=inplace)  # F.dropout's checks of p
        self.p = p

    def forward(self, x):
        if x.ndim not in (3, 4):
            raise ValueError(f"Dropout2d: expected an (N, C, H, W) input, got shape {x.shape}")
        if x.ndim == 3:  # torch reads it as (N, C, L), not as one unbatched (C, H, W) sample
            warnings.warn("Dropout2d: a 3-D input is read as (N, C, L) and each x[n, c] row is "
                          "dropped, as torch does (its Dropout1d); add a batch axis for "
                          "(C, H, W)", UserWarning, stacklevel=2)
        if not self.training or self.p == 0:
            return x
        # one inverted-dropout draw per channel, broadcast over its H × W (or L) values
        ones = backend.get_array_module(x.data).ones(x.shape[:2] + (1,) * (x.ndim - 2), x.dtype)
        return x * F.dropout(Tensor(ones), self.p, training=True)

    def extra_repr(self):
        return f"p={self.p}"


class GELU(Module):
    """GeLU, tanh approximation (GPT-2)."""

    def forward(self, x):
        return F.gelu(x)


class ReLU(Module):
    def forward(self, x):
        return x.relu()


class Identity(Module):
    def forward(self, x):
        return x


class Flatten(Module):
    """(N, d1, d2, ...) -> (N, d1·d2·...)."""

    def forward(self, x):
        return x.reshape(x.shape[0], -1)
