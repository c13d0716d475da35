"""Runs rwkvx's CUDA kernels on the CPU (see README.md here); tests/test_kernels_cpu.py uses it."""
