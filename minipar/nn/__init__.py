"""Neural-network building blocks: Module and Parameter, layers, a tiny GPT, a small ResNet, and a
mixture of experts (MoE, MoEBlock)."""
from . import functional_conv, init  # noqa: F401
from .conv import AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv2d, MaxPool2d  # noqa: F401
from .functional_conv import (adaptive_avg_pool2d, avg_pool2d, batch_norm, conv2d,  # noqa: F401
                              max_pool2d)
from .layers import (GELU, Dropout, Dropout2d, Embedding, Flatten, Identity, LayerNorm,  # noqa: F401
                     Linear, ReLU)
from .moe import MoE, MoEBlock  # noqa: F401
from .module import Module, ModuleList, Parameter, Sequential  # noqa: F401
from .resnet import BasicBlock, ResNet  # noqa: F401
from .transformer import (GPT, MLP, Block, CausalSelfAttention, GPTConfig,  # noqa: F401
                          GPTEmbedding, generate)
