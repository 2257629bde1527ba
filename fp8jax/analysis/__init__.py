"""Importable logic behind the experiments/ scripts (GEMM error, core benchmarks)."""
