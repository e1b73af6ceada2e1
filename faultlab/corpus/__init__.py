"""The corpus: trace files, the shared Redis corpus, replaying."""
