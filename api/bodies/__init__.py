"""Request bodies: the wire types both services accept and their strict, serde-like parsing."""
