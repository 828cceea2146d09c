"""The domain's persistence: events and states to bytes (and back, across format versions), and
recovery. ``journal/`` below it stores opaque bytes and knows nothing of this."""
