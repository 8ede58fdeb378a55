"""Datasets: the JSONL formats checked at upload (formats), the tokenizers (tokenizer), and the
tokenised, packed training blocks a worker reads (datasets).
"""
