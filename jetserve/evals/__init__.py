"""Accuracy and speed evals (GSM8K, MMLU, MT-bench) run as HTTP clients of a jetserve server, and their comparison."""
