"""ZMQ transports: the single-owner trio socket adapter and the peers built on it."""
