"""Token data shared by training and evaluate: tokenizers (tokenizer), raw text sources (sources), the
Megatron indexed format (indexed) and its data.json record (record), opening data with its document
split (dataset, spec), the packed loader (loader, shuffle, blend), and raw text in memory (corpus)."""
