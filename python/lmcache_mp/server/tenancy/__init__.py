"""Tenants: the tenants file, whose each connection is, their namespaces, windows, shares and audit log."""
