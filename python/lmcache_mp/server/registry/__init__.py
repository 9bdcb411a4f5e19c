"""What the engine keeps besides chunks: registrations of KV caches, lookups and their leases, the
clients it knows (and their processes), and the event feed."""
