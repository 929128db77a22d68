"""lordo-fed's tests: unit/ (in-process, the default lane), integration/ (real Flower, torchrun,
the CLIs, benchmark quick modes) and gpu/ (CUDA; skipped with a reason elsewhere)."""
