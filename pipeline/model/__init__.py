"""The LLaMA family as the core owns it: arguments and flavours (args), parameter names and the
Hugging Face / torchtitan / Megatron name tables (names), the sharding table and stage assignment
(sharding), operator kernels (kernels), the nn.Module (transformer), weight sources (weights) and
loading a unified dir into the module (load). ``args``, ``names`` and ``sharding`` import no torch.
"""
