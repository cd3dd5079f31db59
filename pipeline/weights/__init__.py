"""The weight-source layer of the core: every checkpoint format as one plan of global tensors.

``detect.open_source(path)`` recognizes a titan-pipe checkpoint, a torch DCP / torchtitan step, a
Megatron-LM checkpoint (legacy or torch_dist) or a Hugging Face / unified dir and gives its
``SourcePlan`` (source_plan: every global tensor by native name and the boxes of stored tensors
that fill it, pure data) and a ``Store`` to read them (readers/store). Convert streams these plans
into files; titan_pipe.model.weights reads the same plans tensor by tensor, so init_from, resume
and evaluate open every format convert opens.
"""
