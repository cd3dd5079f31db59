"""The LLaMA family as the core owns it: arguments and flavours (args), the one parameter list with
shapes, splits and owners (params), the Hugging Face / torchtitan / Megatron name tables derived
from it (names), the sharding table and stage assignment (sharding), operator kernels (kernels), the
nn.Module (transformer), weight sources (weights) and loading a unified dir into the module (load).
``args``, ``params``, ``names`` and ``sharding`` import no torch.
"""
