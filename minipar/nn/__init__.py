"""Neural-network building blocks: Module and Parameter, layers, torch's loss modules, a tiny GPT,
a small ResNet, and a mixture of experts (MoE, MoEBlock). ``nn.functional`` and ``nn.parallel``
(torch's paths: ``minipar.FACADE``) load when first named."""
import importlib

from . import functional_conv, init  # noqa: F401
from .conv import AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv2d, MaxPool2d  # noqa: F401
from .functional_conv import (adaptive_avg_pool2d, avg_pool2d, batch_norm, conv2d,  # noqa: F401
                              max_pool2d)
from .layers import (GELU, Dropout, Dropout2d, Embedding, Flatten, Identity, LayerNorm,  # noqa: F401
                     Linear, ReLU)
from .loss import BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss, NLLLoss  # noqa: F401
from .moe import MoE, MoEBlock  # noqa: F401
from .module import Module, ModuleList, Parameter, Sequential  # noqa: F401
from .resnet import BasicBlock, ResNet  # noqa: F401
from .transformer import (GPT, MLP, Block, CausalSelfAttention, GPTConfig,  # noqa: F401
                          GPTEmbedding, generate)


def __getattr__(name):
    # PEP 562: ``minipar.nn.parallel`` imports the data-parallel layer (MPI) only when named
    if name in ("functional", "parallel"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'minipar.nn' has no attribute {name!r}")
