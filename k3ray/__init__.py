"""k3ray: serve and evaluate Kimi K3 on a Ray cluster. The core package never imports ray."""

from k3ray.config import ModelConfig, VisionConfig, preset

__version__ = "0.1.0"
__all__ = ["ModelConfig", "VisionConfig", "preset", "__version__"]
