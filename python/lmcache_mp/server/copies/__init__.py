"""Moving bytes between registered KV caches and L1: the server's own copies, the engine's, and
the contexts (CPU shared memory, CUDA IPC) they copy through."""
