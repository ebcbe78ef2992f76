"""A fleet of engine replicas: where sessions are placed, and what each replica holds. A core: no I/O, no clock."""
