"""The protocol layer: frames on the wire, decided-stream events, record ids, errors,
the epoch schedule and the ZooKeeper layout. Pure: no I/O, no clock."""
