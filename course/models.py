"""The two models of the course.  Both take [B, 1, 28, 28] images and return [B, 10] logits."""
import torch
from torch import nn


def mlp() -> nn.Module:
    """The original workshop's model: 784 -> 128 -> 10.  101 770 parameters: tiny, so communication
    is large compared with compute (lesson 7 measures what that means for scaling)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, 10))


class CNN(nn.Module):
    """The convolutional classifier of PyTorch's FashionMNIST training guide (two conv layers, three
    fully connected).  Fewer parameters than the MLP but ~8x its compute per sample: it scales better."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.flatten(1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def build_model(name: str, seed: int) -> nn.Module:
    """The same seed gives the same initial weights in every process."""
    torch.manual_seed(seed)
    return {"mlp": mlp, "cnn": CNN}[name]()
