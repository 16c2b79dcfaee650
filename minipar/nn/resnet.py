"""A small ResNet (He et al. 2016) for 8×8 to 32×32 images, built as one flat ``Sequential``.

    stem: Conv3×3 -> BatchNorm -> ReLU
    stage k (k = 1..4): blocks[k] BasicBlocks of width widths[k], the first one striding by 2
                        from stage 2 on
    head: global average pool -> flatten -> Linear(num_classes)

Being a ``Sequential`` of those layers (stem pieces, each BasicBlock, head pieces), the network can
be cut anywhere between them: the lessons split it across two devices or pipeline stages.
"""
from .conv import AdaptiveAvgPool2d, BatchNorm2d, Conv2d
from .layers import Flatten, Linear, ReLU
from .module import Module, Sequential


class BasicBlock(Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); the shortcut is a strided 1×1
    conv + BatchNorm when the shape changes, else the identity."""

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = BatchNorm2d(out_channels)
        self.conv2 = Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = BatchNorm2d(out_channels)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = Sequential(Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                       BatchNorm2d(out_channels))

    def forward(self, x):
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        return (out + (x if self.shortcut is None else self.shortcut(x))).relu()


class ResNet(Sequential):
    """``ResNet(blocks=(1, 1, 1, 1), widths=(16, 32, 64, 128), in_channels=1, num_classes=10)``."""

    def __init__(self, blocks=(1, 1, 1, 1), widths=(16, 32, 64, 128), in_channels=1,
                 num_classes=10):
        if len(blocks) != len(widths):
            raise ValueError(f"ResNet: {len(blocks)} stage depths but {len(widths)} widths")
        layers = [Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
                  BatchNorm2d(widths[0]), ReLU()]
        channels = widths[0]
        for stage, (depth, width) in enumerate(zip(blocks, widths)):
            for b in range(depth):
                stride = 2 if stage > 0 and b == 0 else 1
                layers.append(BasicBlock(channels, width, stride))
                channels = width
        layers += [AdaptiveAvgPool2d(1), Flatten(), Linear(channels, num_classes)]
        super().__init__(*layers)
