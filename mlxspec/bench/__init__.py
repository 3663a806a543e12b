"""Measuring: the side-by-side benchmark, its summaries, the task benchmark, the suffix store's timing, and the
losslessness check behind ``mlxspec verify``."""
