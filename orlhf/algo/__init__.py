"""Pure tensor math for PPO and its relatives: no torch.distributed, no config, no model code.

Every function takes tensors and returns tensors; shapes follow orlhf/types.py ((B, A) per action token).
"""
