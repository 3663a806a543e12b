"""The parts a round is made of, with no drafter, pacer or loader in them: the tree, the KV cache, sampling,
the target's features, the acceptance rules, the records a round yields, stop strings."""
