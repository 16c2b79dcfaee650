"""torch.nn.functional's path (facade: ``minipar.FACADE``): the functions live in
``minipar.functional``, the losses in ``minipar.losses``, the window ops in
``minipar.nn.functional_conv``.

    import minipar.nn.functional as F          # was: import torch.nn.functional as F
"""
from ..functional import (binary_cross_entropy_with_logits, cross_entropy, dropout,  # noqa: F401
                          gelu, l1_loss, layer_norm, linear, log_softmax, max_pool2d, mse_loss,
                          nll_loss, relu, scaled_dot_product_attention, softmax)
from .functional_conv import adaptive_avg_pool2d, avg_pool2d, batch_norm, conv2d  # noqa: F401
