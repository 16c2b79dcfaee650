"""The basic layers, each a thin Module over one function of ``minipar.functional``."""
from .. import functional as F
from ..autograd import embedding
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
