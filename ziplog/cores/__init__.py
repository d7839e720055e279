"""Sans-I/O protocol cores: events in, a batch of effects out. No sockets, clocks,
threads or ZooKeeper (an import-linter contract checks it)."""
