"""LogBook's sans-I/O cores: the record format (:mod:`.records`) and the index
(:mod:`.index`: an index node's (book, tag) -> seqnums, answers at a cut, and their
aggregation across nodes)."""
