"""ResNet-18/50 (He et al. 2016) as plain PyTorch modules.

Module names follow torchvision (``conv1``, ``bn1``, ``layer1.0.conv1``, ``downsample.0``,
``fc``) so state dicts interchange with torchvision's ResNet when the stem matches
(`cifar_stem=False`, `in_channels=3`). Bottleneck puts the stride on the 3x3 conv
("ResNet v1.5", as torchvision).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.presets import ModelSpec

WIDTHS = (64, 128, 256, 512)


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)


def _downsample(in_ch: int, out_ch: int, stride: int) -> nn.Sequential | None:
    """Projection shortcut (option B of He et al. 2016) when the shape changes."""
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(_conv1x1(in_ch, out_ch, stride), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """Two 3x3 convs; used by ResNet-18/34."""

    expansion = 1
    last_bn = "bn2"  # last BatchNorm of the residual branch (zero-initialised, see init.py)

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_ch, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(in_ch, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4); used by ResNet-50/101/152."""

    expansion = 4
    last_bn = "bn3"

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = _conv1x1(in_ch, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, out_ch)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


LAYOUTS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, ...]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}


class ResNet(nn.Module):
    """images [B, in_channels, H, W] -> logits [B, num_classes]."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.arch not in LAYOUTS:
            raise ValueError(f"ResNet needs arch in {list(LAYOUTS)}, got {spec.arch!r}")
        self.spec = spec
        block, depths = LAYOUTS[spec.arch]
        if spec.cifar_stem:
            # Small images (CIFAR/MNIST): a 7x7/2 conv + max-pool would shrink 32x32 to 8x8
            # before the first stage, so use a 3x3/1 conv and no pooling (He et al. 2016, §4.2).
            self.conv1 = nn.Conv2d(spec.in_channels, 64, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(spec.in_channels, 64, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        in_ch = 64
        for i, (width, depth) in enumerate(zip(WIDTHS, depths, strict=True)):
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(depth):
                blocks.append(block(in_ch, width, stride if j == 0 else 1))
                in_ch = width * block.expansion
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for name in ("layer1", "layer2", "layer3", "layer4"):
            x = getattr(self, name)(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))
