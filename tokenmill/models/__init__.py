"""Model definitions (plain nn.Modules) and the registry that picks one for a checkpoint."""

from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class, supported_architectures

__all__ = ["ArchConfig", "get_model_class", "supported_architectures"]
