"""The process shell every server process shares, below the storage server, the
membership service, the failure handler and the apps' processes: the elected-leader
driver (:mod:`~ziplog.shell.elected`), the cluster key and the run-until-signalled loop
(:mod:`~ziplog.shell.process`), one contained failure per inbound message
(:mod:`~ziplog.shell.inbound`) and rate-limited logs (:mod:`~ziplog.shell.throttled_log`)."""
