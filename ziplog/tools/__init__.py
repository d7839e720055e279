"""Local tooling: the embedded cluster, the ZooKeeper ensemble, process control, the
``ziplog`` command line and the demo."""
