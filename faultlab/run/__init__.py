"""Running steps: the inside of a worker process, and the executors that run a trace."""
