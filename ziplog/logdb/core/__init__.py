"""LogDB's sans-I/O cores: records and validation (no sockets, threads, clocks or disks)."""
