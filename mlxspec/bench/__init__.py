"""Measuring: the side-by-side benchmark, its summaries, the task benchmark, the suffix store's timing, the
server under editor and agent traffic (``measure``), and the losslessness check behind ``mlxspec verify``."""
