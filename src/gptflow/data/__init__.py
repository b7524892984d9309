"""Data stages: sources, readers, tokenizer, tokenization into shards, the training dataset."""
