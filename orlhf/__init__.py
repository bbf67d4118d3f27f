"""orlhf: a Ray-based RLHF trainer. See README.md; the PPO loop is drawn in orlhf/trainer/controller.py."""

__version__ = "0.1.0"
