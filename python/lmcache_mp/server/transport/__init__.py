"""The socket side: the ZeroMQ ROUTER loop and the local lane, the reply routes, who may connect."""
