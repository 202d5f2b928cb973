"""The training scripts the benchmarks launch by path under `monarch-run` or `torchrun`: scripts, not imports
(`mlp.build` and `mlp.SIZES` excepted, which the in-process benchmarks share)."""
