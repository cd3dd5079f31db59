"""Tied embeddings (Llama 3.2 1B/3B, Qwen2.5-0.5B, Qwen3-0.6B, SmolLM2, Gemma 3): the output
projection reads the embedding matrix, one parameter held and stored once, as the embedding.
Field ``model.tie_embeddings``.

It owns how each format states it: config.json's ``tie_word_embeddings`` (every family; a stored
head that differs from the embedding makes the model untied, as transformers reads it:
titan_pipe.model.unified_dir), Megatron-LM's ``untie_embeddings_and_output_weights`` (the
negation), a torchtitan / DCP checkpoint by holding no ``output.weight``. The stages ask the shared
tensor (``features.shared``: the head reads the embedding) instead of this switch; under tensor or
pipeline parallelism the head is a synchronised copy (titan_pipe.training.tied)."""

from __future__ import annotations

from titan_pipe.model.features.feature import Feature

HEAD, EMBEDDING = "output.weight", "tok_embeddings.weight"

FEATURE = Feature(
    name="tie_embeddings",
    label="tied embeddings",
    switch=False,  # any family may tie its head or not: it does not tell families apart
    shares=((HEAD, EMBEDDING),),
    hf_key="tie_word_embeddings",
    megatron_arg="untie_embeddings_and_output_weights",
    megatron_negated=True,
)
