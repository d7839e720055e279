"""I/O adapters: the ports the drivers run on (network, clock, disk, coordination) and
their production implementations (pyzmq, segment files, kazoo)."""
