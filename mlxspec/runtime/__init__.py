"""The process and the machine it runs on: what the machine is, progress bars, the MLX thread, files written
whole, ranks of a sharded job."""
