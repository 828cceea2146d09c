"""ZeroMQ under trio: the socket adapter and the byte budgets used by KV listeners, peers and the fronts."""
