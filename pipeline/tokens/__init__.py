"""Token data shared by training and evaluate: tokenizers (tokenizer) and the corpus reader with its
train/validation split and packed loader (corpus)."""
