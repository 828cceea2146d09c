"""How a service runs: the composition root, the fronts/actor-process split, data directories, logging, exit reasons."""
