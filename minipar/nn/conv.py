"""Image layers as Modules: Conv2d, BatchNorm2d and the pools, over ``functional_conv``."""
from . import functional_conv as Fc
from . import init
from .module import Module, Parameter


class Conv2d(Module):
    """2-D convolution on NCHW input; weight (out, in, kh, kw), PyTorch's U(±1/√fan_in) init."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 dtype="float32"):
        super().__init__()
        kh, kw = Fc._pair(kernel_size)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = (kh, kw), stride, padding
        bound = init.fan_in_bound(in_channels * kh * kw)
        self.weight = Parameter(init.uniform((out_channels, in_channels, kh, kw), bound, dtype))
        self.bias = Parameter(init.uniform((out_channels,), bound, dtype)) if bias else None

    def forward(self, x):
        return Fc.conv2d(x, self.weight, self.bias, self.stride, self.padding)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}")


class BatchNorm2d(Module):
    """Batch normalisation per channel; buffers ``running_mean`` and ``running_var`` are saved in
    the state_dict and move only in training mode (never during a checkpoint recompute)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, dtype="float32"):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(init.ones((num_features,), dtype))
        self.bias = Parameter(init.zeros((num_features,), dtype))
        self.register_buffer("running_mean", init.zeros((num_features,), dtype))
        self.register_buffer("running_var", init.ones((num_features,), dtype))

    def forward(self, x):
        return Fc.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                             self.training, self.momentum, self.eps)

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class MaxPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x):
        return Fc.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(MaxPool2d):
    def forward(self, x):
        return Fc.avg_pool2d(x, self.kernel_size, self.stride, self.padding)


class AdaptiveAvgPool2d(Module):
    """Global average pooling: (N, C, H, W) -> (N, C, 1, 1)."""

    def __init__(self, output_size=1):
        super().__init__()
        self.output_size = output_size

    def forward(self, x):
        return Fc.adaptive_avg_pool2d(x, self.output_size)
