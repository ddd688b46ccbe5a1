"""Training an ``nn.Module`` on a mesh: plans, the captured step, checkpoints (``ctx.wrap``)."""

from .optimizers import UnsupportedOptimizerError
from .plans import DataParallel, ShardedDataParallel
from .trainer import Trainer

__all__ = ["DataParallel", "ShardedDataParallel", "Trainer", "UnsupportedOptimizerError"]
