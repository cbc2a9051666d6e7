"""Kernels, one package per op (reference beside Triton variants); the backend switch is in `backend.py`."""
