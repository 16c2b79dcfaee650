"""torch.nn's loss modules: each holds its options and calls its function in ``losses.py``.

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)   # weight=, ignore_index=, reduction=
    loss = criterion(model(x), y)

The arguments keep torch's order, the deprecated ``size_average`` and ``reduce`` included.
"""
from .. import losses
from .module import Module


class _Loss(Module):
    """A loss module: ``reduction`` checked when it is built, not at its first call."""

    def __init__(self, size_average=None, reduce=None, reduction="mean"):
        super().__init__()
        self.reduction = losses.legacy_reduction(size_average, reduce, reduction)
        losses.check_reduction(type(self).__name__, self.reduction)

    def extra_repr(self):
        return f"reduction={self.reduction!r}"


class CrossEntropyLoss(_Loss):
    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean", label_smoothing=0.0):
        super().__init__(size_average, reduce, reduction)
        self.weight, self.ignore_index, self.label_smoothing = weight, ignore_index, label_smoothing

    def forward(self, input, target):
        return losses.cross_entropy(input, target, weight=self.weight,
                                    ignore_index=self.ignore_index, reduction=self.reduction,
                                    label_smoothing=self.label_smoothing)


class NLLLoss(_Loss):
    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean"):
        super().__init__(size_average, reduce, reduction)
        self.weight, self.ignore_index = weight, ignore_index

    def forward(self, input, target):
        return losses.nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction)


class MSELoss(_Loss):
    def forward(self, input, target):
        return losses.mse_loss(input, target, reduction=self.reduction)


class L1Loss(_Loss):
    def forward(self, input, target):
        return losses.l1_loss(input, target, reduction=self.reduction)


class BCEWithLogitsLoss(_Loss):
    def __init__(self, weight=None, size_average=None, reduce=None, reduction="mean",
                 pos_weight=None):
        super().__init__(size_average, reduce, reduction)
        self.weight, self.pos_weight = weight, pos_weight

    def forward(self, input, target):
        return losses.binary_cross_entropy_with_logits(input, target, weight=self.weight,
                                                       reduction=self.reduction,
                                                       pos_weight=self.pos_weight)
